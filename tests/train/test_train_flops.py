"""The trainer's MFU counts the FLOPs a step runs: with frozen groups, LoRA and an FP8 base, the same as the
planner's step (``csattn.parallel.plan.step_flops``) on one sequence; with everything trained, ``model_flops``."""

import pytest

from csattn.models.deepseek_v4.flops import finetune_flops, model_flops
from csattn.parallel.plan import step_flops, training_spec
from csattn.train.config import TrainConfig, tiny_model_config
from csattn.train.metrics import flop_counts


@pytest.mark.parametrize("options", [dict(lora_rank=4), dict(lora_rank=8, base_precision="fp8", fp8_linears=True),
                                     dict(freeze_groups="experts,embed"), dict()])
def test_step_flops_are_the_planners(options):
    cfg = TrainConfig(**options)
    model_cfg = tiny_model_config()
    counts = flop_counts(cfg, model_cfg)
    got = finetune_flops(model_cfg, [0, 96], **counts)
    t = training_spec(lora_rank=cfg.lora_rank, lora_targets=cfg.lora_targets, train=cfg.train_groups,
                      freeze=cfg.freeze_groups, base_precision=cfg.base_precision, fp8_linears=cfg.fp8_linears)
    bf16, fp8 = step_flops(model_cfg, 96, t)
    assert got["fwd"] + got["bwd"] == pytest.approx(bf16 + fp8, rel=1e-12) and got["fp8"] == pytest.approx(fp8)
    full = model_flops(model_cfg, [0, 96])
    if options:
        assert got["fwd"] + got["bwd"] < full["fwd"] + full["bwd"]  # frozen weights: no weight gradient
    else:
        assert counts == {"frozen_macs": 0, "fp8_macs": 0, "lora_rank": 0, "lora_io": 0}
        assert got["fwd"] + got["bwd"] == full["fwd"] + full["bwd"]
