"""The FLOPs a fine-tuning step runs (``csattn.report.finetune_flops``): everything trained is ``model_flops``; frozen
weights drop their weight-gradient GEMM; LoRA, all factored, adds ``6 r (in + out)`` per token; FP8 GEMMs are counted
apart. By hand, and against the planner's per-sequence count on the V4-Flash slice."""

import pytest

from csattn.models.deepseek_v4.flops import finetune_flops, model_flops
from csattn.parallel.plan import count_groups, load_config, step_flops, training_spec

SLICE = "benchmarks/configs/v4_flash_slice.json"


def test_nothing_frozen_is_model_flops():
    c = load_config(SLICE)
    base = model_flops(c, [0, 1000, 3000])
    assert finetune_flops(c, [0, 1000, 3000], frozen_macs=0.0) == {**base, "fp8": 0.0}


def test_by_hand():
    c = load_config(SLICE)
    cu, T, r = [0, 700, 2048], 2048, 8
    base = model_flops(c, cu)
    got = finetune_flops(c, cu, frozen_macs=1e8, fp8_macs=6e7, lora_rank=r, lora_io=5e4)
    assert got["fwd"] == pytest.approx(base["fwd"] + 2 * r * 5e4 * T, rel=1e-12)
    assert got["bwd"] == pytest.approx(base["bwd"] - 2 * 1e8 * T + 4 * r * 5e4 * T, rel=1e-12)
    assert got["fp8"] == pytest.approx(4 * 6e7 * T, rel=1e-12)


@pytest.mark.parametrize("precision", ["fp8", "w8a16", "bf16"])
def test_matches_the_planner_on_one_sequence(precision):
    """The planner's step on one sequence: every LoRA pair factored (no weight gradient for a frozen weight); every
    frozen FP8 group in FP8."""
    c = load_config(SLICE)
    t = training_spec(lora_rank=16, base_precision=precision)
    groups = count_groups(c).total()
    bf16, fp8 = step_flops(c, 4096, t)
    frozen = sum(v.macs for g, v in groups.items() if g not in t.train)
    held = sum(v.macs for g, v in groups.items() if t.fp8(g)) if precision != "bf16" else 0.0
    io = sum(v.lora_macs for g, v in groups.items() if g in t.lora_targets)
    assert io > 0
    got = finetune_flops(c, [0, 4096], frozen_macs=frozen, fp8_macs=held, lora_rank=16, lora_io=io)
    assert got["fwd"] + got["bwd"] == pytest.approx(bf16 + fp8, rel=1e-12)
    assert got["fp8"] == pytest.approx(fp8, rel=1e-12)


def test_bad_counts_are_refused():
    c = load_config(SLICE)
    with pytest.raises(ValueError, match="fp8_macs a part of frozen_macs"):
        finetune_flops(c, [0, 10], frozen_macs=1.0, fp8_macs=2.0)
