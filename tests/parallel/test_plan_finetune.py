"""The planner's fine-tuning model (CPU, fast): parameters by group against a real model built on the meta device,
LoRA sizes against its modules, the FLOPs run, per-rank memory terms, and V4-Flash's LoRA fine-tune on 8 GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from csattn.models.deepseek_v4 import DeepseekV4ModelConfig
from csattn.parallel.mesh import ParallelDims
from csattn.parallel.plan import (
    FP8_BYTES,
    FP8_GROUPS,
    GROUPS,
    Training,
    count_groups,
    count_params,
    group_of,
    plan,
    step_flops,
    training_spec,
)

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
FLASH = str(CONFIGS / "v4_flash.json")


def _load(name: str, **overrides) -> DeepseekV4ModelConfig:
    return DeepseekV4ModelConfig.from_hf(json.loads((CONFIGS / name).read_text()), **overrides)


def _meta_model(c: DeepseekV4ModelConfig):
    torch = pytest.importorskip("torch")
    from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM

    with torch.device("meta"):
        return DeepseekV4ForCausalLM(c)


def _lora_io(module) -> int:
    """``in + out`` summed over the module's adapted maps, read from the real module: a Linear (or the router)
    ``[out, in]``; the block-diagonal o_a_proj one pair on its 2-D weight ``[g o_lora, H d / g]`` (as csattn's LoRA
    and PEFT's ``ParamWrapper`` make it); the embedding ``[V, D]``; routed experts one pair per expert and matrix
    (``gate_up_proj [E, 2I, D]``, ``down_proj [E, D, I]``)."""
    from torch import nn

    from csattn.layers.modules import GroupedLinear

    name = type(module).__name__
    if isinstance(module, (nn.Linear, nn.Embedding)) or name == "Router":
        return sum(module.weight.shape)
    if isinstance(module, GroupedLinear):
        return sum(module.weight.shape)
    if name == "Experts":
        return sum(p.shape[0] * (p.shape[1] + p.shape[2]) for p in (module.gate_up_proj, module.down_proj))
    return 0


@pytest.mark.parametrize("overrides", [{"num_nextn_predict_layers": 1}, {"num_nextn_predict_layers": 0}])
def test_group_counts_match_the_model_on_meta(overrides):
    c = _load("v4_flash_proxy.json", **overrides)
    model = _meta_model(c)
    params = {g: 0 for g in GROUPS}
    for name, p in model.named_parameters():
        params[group_of(name)] += p.numel()
    matrices = {g: 0 for g in GROUPS}  # bf16- / FP8-held: the weights of the linear maps (the rest stays fp32)
    lora = {g: 0 for g in GROUPS}
    for name, m in model.named_modules():
        io = _lora_io(m)
        if io:
            first = next(n for n, _ in m.named_parameters(recurse=False))
            if not name.startswith("mtp."):  # LoRA adapts the decoder layers only (csattn.finetune.lora)
                lora[group_of(f"{name}.{first}")] += io
            matrices[group_of(f"{name}.{first}")] += sum(p.numel() for p in m.parameters(recurse=False))
    got = count_groups(c).total()
    assert {g: v.params for g, v in got.items()} == params
    assert {g: v.matrix for g, v in got.items()} == matrices
    assert {g: v.lora for g, v in got.items()} == lora
    assert sum(params.values()) == count_params(c).total
    # trained / frozen by group for a fine-tune: what the real model's requires_grad split would give
    t = training_spec(lora_rank=8, train="router,mhc")
    p = plan(c, ParallelDims(world=1), 4096, training=t)
    assert p.params_lora == 8 * sum(lora[g] for g in ("attention", "indexer", "shared_experts", "experts"))
    assert p.params_trained == params["router"] + params["mhc"] + p.params_lora
    # and what csattn's LoRA puts on the model
    from csattn.finetune import LoraSpec, add_lora

    add_lora(model, LoraSpec(8, 16.0, 0.0, ("attention", "indexer", "shared_experts", "experts")))
    assert sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n) == p.params_lora


def test_group_macs_match_model_flops():
    """One token: the FLOP counter's forward is twice the groups' multiply-adds plus each block's attention core
    on its one key (``4 H d``)."""
    from csattn.models.deepseek_v4.flops import model_flops

    for name in ("v4_flash_proxy.json", "v4_flash.json"):
        c = _load(name)
        macs = sum(v.macs for v in count_groups(c).total().values())
        blocks = c.num_hidden_layers + c.num_nextn_predict_layers
        core = blocks * 4 * c.num_attention_heads * c.head_dim
        assert model_flops(c, [0, 1])["fwd"] == 2 * macs + core


def test_frozen_groups_run_no_weight_gradient_and_lora_adds_its_gemms():
    from csattn.models.deepseek_v4.flops import model_flops

    c, T = _load("v4_flash_proxy.json"), 4096
    fl = model_flops(c, [0, T])
    tot = count_groups(c).total()
    assert step_flops(c, T, Training()) == (fl["fwd"] + fl["bwd"], 0.0)
    bf16, fp8 = step_flops(c, T, training_spec(train="head", base_precision="bf16"))
    frozen = sum(v.macs for g, v in tot.items() if g != "head")
    assert fp8 == 0 and bf16 == pytest.approx(fl["fwd"] + fl["bwd"] - 2 * frozen * T, rel=1e-12)
    all_macs = sum(v.macs for v in tot.values())
    # by default the routed experts alone are held (and multiplied) in FP8; --fp8-linears adds the dense groups
    # that LoRA does not adapt, as csattn train holds them
    for linears, groups in ((False, {"experts"}), (True, FP8_GROUPS)):
        bf16, fp8 = step_flops(c, T, training_spec(lora_rank=4, lora_targets="experts", fp8_linears=linears))
        fp8_macs = sum(v.macs for g, v in tot.items() if g in groups)
        assert fp8 == pytest.approx(4 * fp8_macs * T, rel=1e-12)
        assert bf16 == pytest.approx(fl["fwd"] + fl["bwd"] - 2 * all_macs * T - 4 * fp8_macs * T
                                     + 6 * 4 * tot["experts"].lora_macs * T, rel=1e-12)
    # w8a16 holds the experts in FP8 too: the same FLOPs apart (run at the weight-only rate)
    assert step_flops(c, T, training_spec(lora_rank=4, base_precision="w8a16")) == step_flops(
        c, T, training_spec(lora_rank=4, base_precision="fp8"))


def test_memory_terms_of_a_frozen_fp8_base():
    c = _load("v4_flash.json")
    tot = count_groups(c).total()
    t = training_spec(lora_rank=16)
    dims = ParallelDims(dp_shard=1, cp=8, ep=8, world=8)
    p = plan(c, dims, 65536, recompute="block", training=t)
    lora = 16 * sum(tot[g].lora for g in ("attention", "indexer", "shared_experts", "experts"))
    # the routed experts in FP8 (the default, csattn train's), the dense frozen matrices in bf16
    frozen = sum(v.matrix * (FP8_BYTES if g == "experts" else 2) + 4 * v.small for g, v in tot.items())
    assert p.params_trained == p.params_lora == lora
    assert p.memory.parameters == pytest.approx((4 * lora + frozen) / 8)
    assert p.memory.gradients == pytest.approx(4 * lora / 8)
    assert p.memory.optimizer == pytest.approx(8 * lora / 8)
    # 283 B routed-expert parameters in FP8 over EP 8: 1.0001 bytes each, a rank holds its 32 experts only
    assert tot["experts"].params * FP8_BYTES / 8 / 2**30 == pytest.approx(33.0, abs=0.2)
    # EP 8 x efsdp 1: a rank's experts are never gathered; the dense frozen units are, as held
    full = plan(c, dims, 65536, recompute="block")
    assert p.memory.gathered_units < full.memory.gathered_units / 2
    assert p.memory.fp8_workspace > 0 and full.memory.fp8_workspace == 0
    assert p.memory.activations_kept == full.memory.activations_kept  # unchanged by freezing
    # bf16 base: the frozen matrices at 2 bytes; w8a16: FP8-held, the kernel casts each weight tile in registers (no
    # copy of the experts), at the measured weight-only rate
    bf = plan(c, dims, 65536, recompute="block", training=training_spec(lora_rank=16, base_precision="bf16"))
    w8 = plan(c, dims, 65536, recompute="block", training=training_spec(lora_rank=16, base_precision="w8a16"))
    assert bf.memory.parameters > 1.9 * p.memory.parameters
    assert w8.memory.parameters == p.memory.parameters and not w8.memory.fp8_workspace
    assert w8.step_s > p.step_s and w8.step_s > bf.step_s
    assert p.step_s == pytest.approx(bf.step_s, rel=0.1)  # FP8 compute measured at about the bf16 rate
    # --fp8-linears: the frozen dense groups LoRA does not adapt (compressor; the others carry LoRA) in FP8 too
    lin = plan(c, dims, 65536, recompute="block", training=training_spec(lora_rank=16, fp8_linears=True))
    assert lin.memory.parameters == pytest.approx(p.memory.parameters - tot["compressor"].matrix
                                                     * (2 - FP8_BYTES) / 8)


def test_training_flags_are_checked():
    with pytest.raises(ValueError, match="--train and --freeze"):
        training_spec(train="head", freeze="experts")
    with pytest.raises(ValueError, match="--lora-targets: unknown group"):
        training_spec(lora_rank=4, lora_targets="attn")
    with pytest.raises(ValueError, match="--lora-targets mhc"):
        training_spec(lora_rank=4, lora_targets="mhc")
    with pytest.raises(ValueError, match="--lora-targets needs --lora-rank"):
        training_spec(lora_targets="attention")
    with pytest.raises(ValueError, match="also trained in full"):
        training_spec(lora_rank=4, train="attention")
    with pytest.raises(ValueError, match="nothing trains"):
        training_spec(freeze=",".join(GROUPS))
    with pytest.raises(ValueError, match="--base-precision"):
        training_spec(lora_rank=4, base_precision="int4")
    assert training_spec(freeze="experts").train == frozenset(GROUPS) - {"experts"}


def test_v4_flash_lora_fine_tune_fits_on_one_node(capsys):
    from csattn.cli import main

    rc = main(["plan", "--config", FLASH, "--gpus", "8", "--seq-len", "65536", "--lora-rank", "16", "--search"])
    out = capsys.readouterr().out
    assert rc == 0 and "fit: yes" in out and "mesh: dp_replicate 1 x dp_shard" in out
    assert "LoRA rank 16 on attention, indexer, shared_experts, experts" in out
    line = next(x.strip() for x in out.splitlines() if "-m csattn train" in x)
    assert line.startswith("torchrun --nproc-per-node 8 -m csattn train ") and "--lora-rank 16" in line
    assert "--base-precision fp8" in line and "--lora-targets attention,indexer,shared_experts,experts" in line
    # full training does not fit on 8 GPUs; the planner points at the fine-tune
    assert main(["plan", "--config", FLASH, "--gpus", "8", "--seq-len", "65536", "--search"]) == 1
    assert "a LoRA fine-tune (--lora-rank 16, the base frozen): 8 GPU(s)" in capsys.readouterr().out
