"""The FLOPs a fine-tuning step runs (``csattn.report.finetune_flops``): everything trained is ``model_flops``; a
frozen group drops its weight-gradient GEMM; LoRA adds its factored GEMMs; FP8 groups are counted apart. Checked
by hand on one group and against the planner's per-sequence count on the V4-Flash slice."""

import pytest

from csattn.parallel.plan import count_groups, load_config, step_flops, training_spec
from csattn.report import finetune_flops, model_flops

SLICE = "benchmarks/configs/v4_flash_slice.json"


def _groups(c):
    return {g: (v.macs, v.lora_macs) for g, v in count_groups(c).total().items()}


def test_everything_trained_is_model_flops():
    c = load_config(SLICE)
    cu = [0, 1000, 3000]
    groups = _groups(c)
    got = finetune_flops(c, cu, groups, trained=groups)
    base = model_flops(c, cu)
    assert got == {"fwd": base["fwd"], "bwd": base["bwd"], "fp8": 0.0}


def test_frozen_group_and_lora_by_hand():
    c = load_config(SLICE)
    cu = [0, 700, 2048]
    groups = _groups(c)
    base = model_flops(c, cu)
    macs, io = groups["experts"]
    got = finetune_flops(c, cu, groups, trained=[g for g in groups if g != "experts"], lora_rank=8,
                         lora_targets=["experts"], fp8_groups=["experts"])
    assert got["fwd"] == pytest.approx(base["fwd"] + 2 * 8 * io * 2048, rel=1e-12)
    assert got["bwd"] == pytest.approx(base["bwd"] - 2 * macs * 2048 + 4 * 8 * io * 2048, rel=1e-12)
    assert got["fp8"] == pytest.approx(4 * macs * 2048, rel=1e-12)


@pytest.mark.parametrize("precision", ["fp8", "w8a16", "bf16"])
def test_matches_the_planner_on_one_sequence(precision):
    c = load_config(SLICE)
    t = training_spec(lora_rank=16, base_precision=precision)
    bf16, fp8 = step_flops(c, 4096, t)
    fp8_groups = [g for g in count_groups(c).total() if t.fp8(g) and precision == "fp8"]
    got = finetune_flops(c, [0, 4096], _groups(c), t.train, t.lora_rank, t.lora_targets, fp8_groups)
    assert got["fwd"] + got["bwd"] == pytest.approx(bf16 + fp8, rel=1e-12)
    assert got["fp8"] == pytest.approx(fp8, rel=1e-12)


def test_unknown_group_is_refused():
    c = load_config(SLICE)
    with pytest.raises(ValueError, match="no counts"):
        finetune_flops(c, [0, 10], {"experts": (1.0, 1.0)}, trained=["attention"])
