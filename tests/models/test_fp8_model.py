"""FP8-held frozen weights (``base_precision="fp8"`` / ``"w8a16"``): a release-format checkpoint loads with its
routed experts (and, asked, its dense linears) held as e4m3 bit for bit what the release stores (MXFP4 converted
exactly); the model computes what the same model with the dequantized weights computes, gradients included (they
reach the layers before the frozen experts); ``to()``, the ``state_dict``, save / load, meta init and expert
parallelism keep the FP8 tensors as they are; loading never holds a layer's experts in full precision."""

import os

import pytest
import torch

from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig, load_pretrained
from csattn.models.deepseek_v4.checkpoint import held_linears
from csattn.models.deepseek_v4.quant import Fp8Experts, Fp8Linear, dequantize_fp8, hold_in_fp8, mxfp4_to_fp8
from csattn.models.deepseek_v4.release import write_release_checkpoint
from csattn.packing import PackedSeqs
from tests.models.model_utils import disk, tiny_config_dict

BLOCK = (128, 128)


def tiny_config(**kw) -> DeepseekV4ModelConfig:
    raw = tiny_config_dict("flash", mtp=1)
    # D = 64 (two MXFP4 groups), I = 128 (gate and up each one 128-row block), 8 experts
    raw.update(hidden_size=64, moe_intermediate_size=128, n_routed_experts=8, **kw)
    return DeepseekV4ModelConfig.from_hf(raw)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    path = tmp_path_factory.mktemp("release")
    write_release_checkpoint(tiny_config(), str(path), seed=3)
    return str(path)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def test_experts_are_held_as_the_converted_release_values(release):
    model = load_pretrained(release, base_precision="fp8")
    assert model.load_report.fp8 == 5 * 2 * 8 and not model.load_report.fp8_inexact  # 4 layers + MTP, 2 per expert
    for prefix, i in (("model.layers.2", "layers.2"), ("mtp.0", "mtp.0")):
        experts = model.get_submodule(f"{prefix}.mlp.experts")
        assert isinstance(experts, Fp8Experts) and experts.gate_up_proj.dtype == torch.float8_e4m3fn
        assert not any(p.requires_grad for p in experts.parameters())
        for e in (0, 5):
            w1, w3, w2 = (f"{i}.ffn.experts.{e}.{w}" for w in ("w1", "w3", "w2"))
            packed = torch.cat([disk(release, w1 + ".weight"), disk(release, w3 + ".weight")])
            scale = torch.cat([disk(release, w1 + ".scale"), disk(release, w3 + ".scale")])
            q, s, inexact = mxfp4_to_fp8(packed, scale)
            assert not inexact.any()
            assert torch.equal(raw_bytes(experts.gate_up_proj[e]), raw_bytes(q))
            assert torch.equal(experts.gate_up_proj_scale_inv[e], s)
            q, s, _ = mxfp4_to_fp8(disk(release, w2 + ".weight"), disk(release, w2 + ".scale"))
            assert torch.equal(raw_bytes(experts.down_proj[e]), raw_bytes(q))
            assert torch.equal(experts.down_proj_scale_inv[e], s)
    # the dense linears stay dequantized by default; with fp8_linears the release's FP8 tensors as they are
    assert type(model.model.layers[0].self_attn.q_b_proj) is torch.nn.Linear
    dense = load_pretrained(release, base_precision="w8a16", fp8_linears=True)
    wq_b = dense.model.layers[1].self_attn.q_b_proj
    assert isinstance(wq_b, Fp8Linear) and wq_b.compute == "w8a16"
    assert torch.equal(raw_bytes(wq_b._parameters["weight"]), raw_bytes(disk(release, "layers.1.attn.wq_b.weight")))
    scale = disk(release, "layers.1.attn.wq_b.scale")
    assert torch.equal(wq_b.weight_scale_inv, torch.exp2(scale.view(torch.uint8).float() - 127))
    assert {n.rsplit(".", 1)[-1] for n in held_linears(release)} >= {"q_a_proj", "q_b_proj", "kv_proj", "o_a_proj",
                                                                      "o_b_proj", "gate_proj", "e_proj"}


def step(model: DeepseekV4ForCausalLM, seed: int = 0):
    """Loss, logits and the gradients of every trainable parameter of one packed step."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (40,), generator=g)
    packed = PackedSeqs.from_lengths([17, 23])
    out = model(ids, packed=packed, labels=torch.roll(ids, -1))
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), out.logits.detach(), grads


@pytest.mark.parametrize("compute,fp8_linears", [("fp8", False), ("w8a16", True)])
def test_fp8_held_model_equals_the_dequantized_model(release, compute, fp8_linears):
    """fp64 on the CPU: the FP8 ops run their references (the weight dequantized to the activations' dtype), so
    the FP8-held model and the model loaded with dequantized weights agree to fp64 rounding, loss, logits and
    every trainable gradient (the embedding's too: the gradient crosses the frozen experts)."""
    ref = load_pretrained(release, dtype=torch.float64)
    model = load_pretrained(release, dtype=torch.float64, base_precision=compute, fp8_linears=fp8_linears)
    assert model.model.layers[3].mlp.experts.dtype_tag.dtype == torch.float64
    loss, logits, grads = step(model)
    ref_loss, ref_logits, ref_grads = step(ref)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-12)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert "model.layers.0.mlp.experts.gate_up_proj" in frozen
    assert ("model.layers.0.self_attn.q_b_proj.weight" in frozen) == fp8_linears
    assert set(grads) == set(ref_grads) - frozen
    for name, g in grads.items():
        assert g is not None and torch.isfinite(g).all(), name
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-9, atol=1e-12, msg=name)
    emb = grads["model.embed_tokens.weight"]
    assert emb.abs().sum() > 0


@pytest.mark.parametrize("backend", ["reference", "grouped", "triton"])
def test_frozen_fp8_experts_pass_the_input_gradient(release, backend):
    """One FP8 expert layer (fp32, every backend of the MoE op; the Triton SwiGLU under TRITON_INTERPRET) against
    the full-precision layer holding the dequantized weights: output, input and routing-weight gradients."""
    model = load_pretrained(release, layers=[2], base_precision="fp8")
    fp8 = model.model.layers[2].mlp.experts
    fp8.backend = backend
    gate_up, down = fp8.dequantized()
    assert gate_up.dtype == torch.float32
    assert torch.equal(gate_up, dequantize_fp8(fp8.gate_up_proj, fp8.gate_up_proj_scale_inv, BLOCK))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 64, generator=g, requires_grad=True)
    ids = torch.randint(0, 8, (24, 2), generator=g)
    w = torch.rand(24, 2, generator=g, requires_grad=True)
    dy = torch.randn(24, 64, generator=g)
    from csattn.ops.moe import experts_ref

    y = fp8(x, ids, w)
    (y * dy).sum().backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yr = experts_ref(xr, ids, wr, gate_up, down, fp8.limit)
    (yr * dy).sum().backward()
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-6)
    assert x.grad.abs().sum() > 0 and w.grad.abs().sum() > 0
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-6)
    assert fp8.gate_up_proj.grad is None


def test_to_state_dict_and_save_round_trip(release, tmp_path):
    model = load_pretrained(release, base_precision="fp8", fp8_linears=True)
    before = {k: raw_bytes(v).clone() for k, v in model.state_dict().items()}
    assert model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    assert model.state_dict()["model.layers.0.mlp.experts.gate_up_proj_scale_inv"].shape == (8, 2, 1)
    assert "model.layers.0.self_attn.q_b_proj.weight_scale_inv" in before
    assert not any(k.endswith("dtype_tag") for k in before)  # the compute dtype is not state
    # to(dtype): the compute dtype follows, the codes and scales keep theirs (and their bytes)
    model.to(torch.float64)
    attn = model.model.layers[1].self_attn
    assert attn.q_b_proj.weight.dtype == torch.float64 and attn.q_a_proj.weight_scale_inv.dtype == torch.float32
    assert attn.q_b_proj._parameters["weight"].dtype == torch.float8_e4m3fn
    model.to_training_dtype(torch.bfloat16)
    assert attn.o_b_proj.weight.dtype == torch.bfloat16 and model.model.layers[1].mlp.experts.dtype_tag.dtype == \
        torch.bfloat16
    for k, v in model.state_dict().items():
        if v.dtype in (torch.float8_e4m3fn,) or k.endswith("_scale_inv"):
            assert torch.equal(raw_bytes(v), before[k]), k
    # load_state_dict into a fresh FP8-held model, then save and load back: bit for bit
    other = load_pretrained(release, base_precision="fp8", fp8_linears=True)
    with torch.no_grad():
        other.model.layers[2].mlp.experts.gate_up_proj.zero_()
    other.load_state_dict(load_pretrained(release, base_precision="fp8", fp8_linears=True).state_dict())
    model = load_pretrained(release, base_precision="fp8", fp8_linears=True)
    model.save_pretrained(str(tmp_path))
    back = load_pretrained(str(tmp_path), base_precision="fp8", fp8_linears=True)
    for state in (other.state_dict(), back.state_dict()):
        assert set(state) == set(before)
        for k, v in state.items():
            assert torch.equal(raw_bytes(v), before[k]), k
    # and dequantized, it equals the release dequantized
    want = load_pretrained(release).state_dict()
    got = load_pretrained(str(tmp_path)).state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_meta_init_and_expert_parallel_slices():
    """hold_in_fp8 on the meta device gives FP8 shapes without storage; MoE.use_expert_parallel slices FP8
    experts like full-precision ones."""
    c = tiny_config()
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(c)
    hold_in_fp8(model, "fp8", ["model.layers.0.self_attn.q_b_proj"])
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, Fp8Experts) and experts.gate_up_proj.is_meta
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.down_proj_scale_inv.shape == (8, 1, 1)
    assert isinstance(model.model.layers[0].self_attn.q_b_proj, Fp8Linear)
    model.to_empty(device="cpu")
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and not experts.gate_up_proj.is_meta
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.arange(8.0).view(8, 1, 1).expand_as(experts.gate_up_proj))
        experts.gate_up_proj_scale_inv.copy_(torch.arange(1.0, 9.0).view(8, 1, 1).expand(8, 2, 1))

    class Share:  # an expert-parallel group's view from rank 1 of 4
        num_experts, size, rank, group = 8, 4, 1, None
        local_experts = range(2, 4)

    moe = model.model.layers[1].mlp
    moe.use_expert_parallel(Share())
    part = moe.experts
    assert isinstance(part, Fp8Experts) and part.local == range(2, 4) and part.gate_up_proj.shape[0] == 2
    assert part.gate_up_proj[:, 0, 0].float().tolist() == [2.0, 3.0]
    assert part.gate_up_proj_scale_inv[:, 0, 0].tolist() == [3.0, 4.0]
    with pytest.raises(ValueError, match="no initializer"):
        part.reset_parameters()


def test_fp8_held_attention_reads_its_dtype_without_dequantizing(monkeypatch):
    """The attention's input check reads an FP8-held ``q_a_proj``'s compute dtype from its tag: ``weight`` (a fresh
    dequantization of the whole matrix) is not read on every forward."""
    import csattn.models.deepseek_v4.quant as quant

    c = tiny_config()
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(c)
    hold_in_fp8(model, "fp8", ["model.layers.0.self_attn.q_a_proj"])
    model.to_empty(device="cpu")
    attn = model.model.layers[0].self_attn
    assert attn.compute_dtype() == attn.q_a_proj.weight.dtype == torch.float32

    def refuse(*args, **kwargs):
        raise AssertionError("dequantized")

    monkeypatch.setattr(quant, "dequantize", refuse)
    assert attn.compute_dtype() == torch.float32


def test_loading_never_holds_a_layer_of_experts_in_full_precision(release):
    """Every tensor created while loading, by size: the largest full-precision one is one expert matrix (the
    conversion's), never the layer's experts, let alone the model."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and not t.is_meta and t.dtype in (torch.float32, torch.bfloat16,
                                                                                 torch.float64):
                    self.most = max(self.most, t.numel())
            return out

    c = tiny_config()
    one_expert = 2 * c.moe_intermediate_size * c.hidden_size
    with Largest() as seen:
        load_pretrained(release, base_precision="fp8", dtype=torch.bfloat16)
    assert one_expert <= seen.most <= one_expert * 2 < c.n_routed_experts * one_expert
    with Largest() as seen:  # the dequantizing load holds them all (the contrast that makes the bound mean something)
        load_pretrained(release, dtype=torch.bfloat16)
    assert seen.most >= c.n_routed_experts * one_expert


def _bytes_of(model) -> dict[str, torch.Tensor]:
    return {k: raw_bytes(v) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_converting_on_the_target_device_changes_no_bit(release, precision, monkeypatch):
    """``convert_device``: each quantized tensor is moved there and converted (MXFP4 -> FP8) or dequantized there,
    one at a time; the model (on the host) holds the same bytes as a load converting on the host."""
    from csattn.models.deepseek_v4 import disk as ck  # where the loader reads and converts each tensor

    seen = []
    real = ck.mxfp4_to_fp8 if precision == "fp8" else ck.dequantize_mxfp4
    monkeypatch.setattr(ck, real.__name__, lambda packed, scale, *a, **k: (seen.append(
        (packed.device, scale.device, packed.numel())), real(packed, scale, *a, **k))[1])
    want = _bytes_of(load_pretrained(release, base_precision=precision))
    n = len(seen)
    got = _bytes_of(load_pretrained(release, base_precision=precision, convert_device=torch.device("cpu")))
    assert want.keys() == got.keys() and all(torch.equal(v, got[k]) for k, v in want.items())
    c = tiny_config()
    # one expert matrix per call (4 layers + MTP; fp8: gate_up and down, bf16: w1, w3, w2), 2 values a byte
    per = 2 if precision == "fp8" else 3
    assert len(seen) == 2 * n and n == 5 * per * 8
    assert max(m for _, _, m in seen) == c.moe_intermediate_size * c.hidden_size // (1 if precision == "fp8" else 2)


def test_release_drawn_on_the_device_holds_the_same_tensors_at_the_same_scales(release, tmp_path):
    """``draw="device"`` (benchmarks' fast checkpoints): the same files, names, shapes and dtypes as the model's own
    draw, every tensor at the model's scale (std within 30 %), other values."""
    fast = str(tmp_path / "fast")
    write_release_checkpoint(tiny_config(), fast, seed=3, draw="device")
    assert sorted(os.listdir(fast)) == sorted(os.listdir(release))
    want, got = load_pretrained(release).state_dict(), load_pretrained(fast).state_dict()
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert got[k].shape == v.shape and got[k].dtype == v.dtype, k
        if v.is_floating_point() and v.numel() > 1 and v.std() > 0:
            assert 0.7 < float(got[k].std() / v.std()) < 1.3, k
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(got[experts], want[experts])
    with pytest.raises(ValueError, match="draw must be"):
        write_release_checkpoint(tiny_config(), fast, draw="gpu")


def test_inexact_blocks_are_refused_unless_allowed(tmp_path):
    from safetensors.torch import load_file, save_file

    path = str(tmp_path)
    weight_map = write_release_checkpoint(tiny_config(), path, seed=4)
    key = "layers.3.ffn.experts.6.w2.scale"
    shard = os.path.join(path, weight_map[key])
    tensors = load_file(shard)
    s = tensors[key].view(torch.uint8).clone()
    s[5, 0] = max(int(s[5, 0]) - 40, 1)  # one group 2**40 below its block's others
    tensors[key] = s.view(torch.float8_e8m0fnu)
    save_file(tensors, shard)
    with pytest.raises(ValueError, match=r"1 MXFP4 blocks of 1 expert.*model\.layers\.3\.mlp\.experts\.down_proj\[6\]"):
        load_pretrained(path, base_precision="fp8")
    model = load_pretrained(path, base_precision="fp8", allow_inexact_fp8=True)
    assert model.load_report.fp8_inexact == {"model.layers.3.mlp.experts.down_proj[6]": 1}
    # the dequantizing load is exact whatever the scales
    assert load_pretrained(path).load_report.fp8 == 0
    with pytest.raises(ValueError, match="base_precision must be one of"):
        load_pretrained(path, base_precision="fp4")
    with pytest.raises(ValueError, match="needs base_precision"):
        load_pretrained(path, fp8_linears=True)


def gather_bytes(t):
    """A sharded ``DTensor``'s whole value, gathered as raw bytes (gloo has no float8 collectives)."""
    from torch.distributed.tensor import DTensor

    raw = DTensor.from_local(t.to_local().view(torch.uint8), t.device_mesh, t.placements, run_check=False)
    return raw.full_tensor().view(t.dtype)


def ep_load_task(group, path: str, fsdp: bool, bf16: bool = False) -> dict:
    """Rank's share of a meta model with FP8-held experts split over the group (``fsdp``: through
    ``csattn.parallel.parallelize`` with FSDP beside EP), loaded per rank: the tensors it read, its experts, and
    the loss and embedding gradient of one step on the rank's own rows. ``bf16``: FSDP computes in bf16 over
    fp32 storage, and the dense linears the release stores in FP8 are held too."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from csattn.models.deepseek_v4 import checkpoint as ck
    from csattn.models.deepseek_v4 import disk
    from csattn.models.deepseek_v4.expert_parallel import ExpertParallel
    from csattn.models.deepseek_v4.moe import MoE
    from csattn.parallel import ParallelDims, build_meshes, load_hf_sharded, parallelize
    from csattn.parallel.init import local_experts

    torch.set_num_threads(1)
    raw = ck.read_config(path)
    config = DeepseekV4ModelConfig.from_hf(raw, num_nextn_predict_layers=raw["num_nextn_predict_layers"])
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    hold_in_fp8(model, "fp8", ck.held_linears(path) if bf16 else ())
    if fsdp:  # 4 ranks: ep = 2, FSDP over 4 (the frozen experts stay whole on both ranks of an ep share)
        parallelize(model, build_meshes(ParallelDims(dp_shard=dist.get_world_size(group), ep=2), "cpu"),
                    param_dtype=torch.bfloat16 if bf16 else None)
    else:
        for m in model.modules():
            if isinstance(m, MoE):
                m.use_expert_parallel(ExpertParallel(group, config.n_routed_experts))
    read, real = [], disk.get_tensor  # every tensor read from a file goes through it

    def spy(shards, files, key, expert):
        read.append(key)
        return real(shards, files, key, expert)

    disk.get_tensor = spy
    try:
        load_hf_sharded(model, path, "cpu")
    finally:
        disk.get_tensor = real
    experts = {}
    for name, module in model.named_modules():
        if isinstance(module, Fp8Experts):
            for t in module.frozen_storage:
                value = getattr(module, t)
                if isinstance(value, DTensor):  # FSDP's shard over the expert data-parallel ranks: gather it
                    value = gather_bytes(value)
                experts[f"{name}.{t}"] = raw_bytes(value).clone()
    # and it trains: each rank's own rows through the split FP8 experts (the tokens exchanged over the group)
    loss, _, grads = step(model, seed=dist.get_rank())
    emb = grads["model.embed_tokens.weight"]
    emb = emb.full_tensor() if isinstance(emb, DTensor) else emb
    return {"local": list(local_experts(model)), "read": read, "experts": experts, "loss": loss, "emb": emb}


@pytest.mark.slow
@pytest.mark.parametrize("fsdp,bf16", [(False, False), (True, False), (True, True)],
                         ids=["ep4", "dp_shard4-ep2", "dp_shard4-ep2-bf16-fp8_linears"])
def test_expert_parallel_ranks_read_only_their_experts_and_train(release, fsdp, bf16):
    from tests.cp_pool import shared_pool

    full = load_pretrained(release, base_precision="fp8").state_dict()
    out = shared_pool(4).run_ok(ep_load_task, 4, path=release, fsdp=fsdp, bf16=bf16)
    # ep = 4 alone: 2 experts a rank; FSDP beside ep = 2: 4 experts a rank, ep groups of consecutive ranks
    share = [range(2 * r, 2 * r + 2) for r in range(4)] if not fsdp else [range(4 * (r % 2), 4 * (r % 2) + 4)
                                                                           for r in range(4)]
    assert [r["local"] for r in out] == [list(x) for x in share]
    for rank, res in enumerate(out):
        lo, hi = share[rank].start, share[rank].stop
        experts_read = {int(k.split(".ffn.experts.")[1].split(".")[0]) for k in res["read"] if ".ffn.experts." in k}
        assert experts_read == set(share[rank]), rank
        assert len(res["experts"]) == 5 * 4  # 4 layers + 1 MTP block, 2 tensors + 2 scales each
        for name, got in res["experts"].items():
            assert torch.equal(got, raw_bytes(full[name][lo:hi])), (rank, name)
    # one process, each rank's rows: the same loss; the embedding's gradient (FSDP: summed over the ranks, its
    # divide factor 1)
    whole = [step(load_pretrained(release, base_precision="fp8"), seed=rank) for rank in range(4)]
    emb = [g[2]["model.embed_tokens.weight"] for g in whole]
    if bf16:  # the FP8 codes survive FSDP's bf16 compute: the loss within bf16's rounding of the fp32 one
        for rank, res in enumerate(out):
            torch.testing.assert_close(res["loss"], whole[rank][0], rtol=1e-2, atol=0)
            assert res["emb"].abs().sum() > 0
        return
    for rank, res in enumerate(out):
        torch.testing.assert_close(res["loss"], whole[rank][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res["emb"], sum(emb) if fsdp else emb[rank], rtol=1e-4, atol=1e-6)


def test_fp8_held_weights_come_only_from_a_quantized_checkpoint(tmp_path):
    """Fresh weights cannot fill FP8-held modules (materialize), and a plain checkpoint cannot be loaded FP8-held:
    both refuse by name instead of casting values without scales."""
    from csattn.parallel import materialize

    c = tiny_config(num_nextn_predict_layers=0)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(c)
    hold_in_fp8(model, "fp8")
    with pytest.raises(ValueError, match=r"mlp\.experts\.gate_up_proj.*FP8-held"):
        materialize(model, "cpu", seed=0)
    DeepseekV4ForCausalLM(c).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="no quantization_config.*base_precision='bf16'"):
        load_pretrained(str(tmp_path), base_precision="fp8")
    with pytest.raises(ValueError, match="compute must be 'fp8'"):
        hold_in_fp8(model, "fp16")


def dcp_task(group, path: str, out: str, export: str) -> bool:
    """FP8-held experts split over ep = 2 (efsdp = 2: the dense layers FSDP-sharded over 4 ranks, the frozen
    experts whole on both ranks of an ep share) through a DCP training checkpoint: saved, wiped, read back; whether
    every rank's codes and scales came back bit for bit. Then the gathered HF export to ``export``."""
    from torch.distributed.tensor import DTensor

    from csattn.models.deepseek_v4 import checkpoint as ck
    from csattn.parallel import ParallelDims, build_meshes, export_hf, load_hf_sharded, parallelize
    from csattn.parallel.checkpoint import load_sharded, save_sharded

    torch.set_num_threads(1)
    raw = ck.read_config(path)
    config = DeepseekV4ModelConfig.from_hf(raw, num_nextn_predict_layers=raw["num_nextn_predict_layers"])
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    hold_in_fp8(model, "fp8")
    meshes = build_meshes(ParallelDims(dp_shard=4, ep=2), "cpu")
    parallelize(model, meshes)
    load_hf_sharded(model, path, "cpu")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    held = [m for m in model.modules() if isinstance(m, Fp8Experts)]

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    with torch.no_grad():  # scales that differ between the ep ranks' experts (a plain tensor keeps one rank's)
        for m in held:
            local(m.down_proj_scale_inv).mul_(2.0 ** (1 + m.local.start))
    before = [raw_bytes(local(getattr(m, n))).clone() for m in held for n in m.frozen_storage]
    save_sharded(out, model, opt, meshes)
    with torch.no_grad():
        for m in held:
            for n in m.frozen_storage:
                local(getattr(m, n)).view(torch.uint8).zero_()
    load_sharded(out, model, opt, meshes)
    after = [raw_bytes(local(getattr(m, n))) for m in held for n in m.frozen_storage]
    export_hf(model, export, meshes)
    return all(torch.equal(a, b) for a, b in zip(before, after)) and len(before) == 5 * 4


@pytest.mark.slow
def test_training_checkpoint_and_export_keep_each_ranks_fp8_experts(release, tmp_path):
    from tests.cp_pool import shared_pool

    export = str(tmp_path / "export")
    assert shared_pool(4).run_ok(dcp_task, 4, path=release, out=str(tmp_path / "ckpt"), export=export) == [True] * 4
    # the gathered export writes the FP8-held experts as held (scales multiplied by 2, 32 for the two ep shares)
    want = load_pretrained(release, base_precision="fp8").state_dict()
    got = load_pretrained(export, base_precision="fp8").state_dict()
    assert set(got) == set(want)
    for name, t in want.items():
        if name.endswith("down_proj_scale_inv"):
            t = t * torch.tensor([2.0] * 4 + [32.0] * 4).view(8, 1, 1)
        assert torch.equal(raw_bytes(got[name]), raw_bytes(t)), name


def test_fp8_held_model_under_autocast_equals_the_dequantized_one(release):
    """Under ``torch.autocast`` (fp32 storage, bf16 compute) the FP8-held layers compute in bf16 too (the attention
    reads its FP8 projections in the autocast dtype), with the same bf16 weights as the dequantized model's casts
    (an e4m3 value times a power of two is exact in bf16): same loss, logits and embedding gradient up to bf16
    accumulation order."""
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(0))
    got = {}
    for name, kw in (("ref", {}), ("fp8", dict(base_precision="fp8", fp8_linears=True))):
        model = load_pretrained(release, **kw)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, packed=PackedSeqs.from_lengths([17, 23]), labels=torch.roll(ids, -1))
        out.loss.backward()
        got[name] = (out.loss.detach(), out.logits.detach(), model.model.embed_tokens.weight.grad)
    assert model.model.layers[0].self_attn.q_b_proj.dtype_tag.dtype == torch.float32  # restored after the layer
    assert got["fp8"][1].dtype == torch.bfloat16
    for a, b in zip(got["fp8"], got["ref"]):
        torch.testing.assert_close(a, b)
