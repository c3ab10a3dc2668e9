"""Quantized DeepSeek-V4 checkpoints (FP8 e4m3 block-scaled linears, MXFP4 experts, as released): tiny ones
written here with our own quantizer in DeepSeek's reference names and in HF's, read back by ``load_pretrained``;
the dequantized weights equal ``transformers``' own dequantization bit for bit and the original weights within
the quantization error; a ``layers=`` / ``filter=`` load opens only the shards it needs."""

import json
import math
import os

import pytest
import torch

from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig, load_pretrained
from csattn.models.deepseek_v4.checkpoint import experts_filter
from csattn.models.deepseek_v4.names import internal_name, to_disk
from csattn.models.deepseek_v4.quant import E2M1_VALUES, dequantize_fp8, dequantize_mxfp4
from csattn.models.deepseek_v4.release import quantize_fp8_blocks as quantize_fp8  # the release writer's quantizers
from csattn.models.deepseek_v4.release import quantize_mxfp4
from csattn.models.deepseek_v4.release import release_kind as kind_of  # what the release quantizes, by name
from csattn.packing import PackedSeqs
from tests.models.model_utils import randomize_model_, tiny_config_dict

FP8_MAX = 448.0


def fp8_bound(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per-element bound on |dequant - w|: e4m3 keeps 3 mantissa bits, so rounding w/s costs at most half a step,
    2^-4 relative for normals, and half the subnormal step 2^-9 (2^-10) times s below 2^-6; plus the fp32
    division w/s (2^-24 relative, taken as 2^-20 with margin for the rounding of the bound itself)."""
    s = _expand(_as_float(scale), block, w.shape)
    return (2**-4 + 2**-20) * w.abs() + 2**-10 * s


def fp4_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e2m1 steps are 0.5 below 2, 1 in [2, 4), 2 in [4, 6]: rounding costs at most 1/4 of |w/s| above 1 and 1/4 of
    s below (w/s stays within [-6, 6] by the choice of s)."""
    s = _as_float(scale).repeat_interleave(32, dim=-1)[..., : w.shape[-1]]
    return w.abs() / 4 + s / 4


def _as_float(scale):
    return torch.exp2(scale.float() - 127) if scale.dtype == torch.uint8 else scale.float()


def _expand(s, block, shape):
    bn, bk = block
    return s.repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., : shape[-2], : shape[-1]]


# -------------------------------------------------------------------------------- transformers' dequantization
def hf_fp8(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    if scale.dtype == torch.uint8:  # its ue8m0 dtype (the quantizer reinterprets uint8 bytes the same way)
        scale = scale.view(torch.float8_e8m0fnu)
    return _dequantize_fp8_weight(q, scale, list(block), torch.float32)


def hf_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(packed.view(torch.int8), scale, output_dtype=torch.float32)


# ------------------------------------------------------------------------------------------ tiny checkpoints
def tiny_raw(mtp: int = 1, tie: bool = False) -> dict:
    raw = tiny_config_dict("flash", mtp=mtp, tie=tie)
    raw.update(hidden_size=64, moe_intermediate_size=64)  # two MXFP4 groups along K in every expert matrix
    return raw


def tiny(seed: int = 0, **kw) -> DeepseekV4ForCausalLM:
    cfg = DeepseekV4ModelConfig.from_hf(tiny_raw(**kw))
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg)
    randomize_model_(model, seed + 1)
    return model


def write_quantized(model, path, *, convention: str, block=(16, 16), scale_kind="e8m0", expert_scale="e8m0",
                    shard_of=None) -> dict:
    """Write ``model`` quantized as released. ``convention``: ``"reference"`` (DeepSeek's names, per-expert
    matrices, ``<name>.scale``, legacy ``compress_ratios``, top-level ``expert_dtype``) or ``"hf"`` (HF's names,
    fused ``gate_up_proj [E, 2I, D]``, ``*_scale_inv``). Returns ``{disk name: tensor}`` as written."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    # the release's names carry no "model." prefix (transformers writes one back; both load)
    tensors = {k.removeprefix("model."): v for k, v in to_disk(state).items()} if convention == "reference" else state
    out = {}
    for name, t in tensors.items():
        kind = kind_of(internal_name(name))
        if kind == "keep":
            out[name] = t
            continue
        if kind == "bf16":
            out[name] = t.to(torch.bfloat16)
            continue
        scale_name = (name[: -len("weight")] + "scale") if convention == "reference" else name + "_scale_inv"
        if kind == "fp8":
            out[name], out[scale_name] = quantize_fp8(t, block, scale_kind)
        else:
            flat = t.reshape(-1, t.shape[-1])
            q, s = quantize_mxfp4(flat, expert_scale, torch.int8 if convention == "reference" else torch.uint8)
            out[name], out[scale_name] = q.view(*t.shape[:-1], -1), s.view(*t.shape[:-1], -1)
    cfg = model.config.to_hf_dict()
    cfg["num_nextn_predict_layers"] = len(model.mtp)
    qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block), "activation_scheme": "dynamic",
          "scale_fmt": "ue8m0" if scale_kind != "fp32" else None}
    if convention == "reference":
        ratio = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        cfg["compress_ratios"] = [ratio[t] for t in cfg.pop("layer_types")] + [0] * len(model.mtp)
        cfg["expert_dtype"] = "fp4"
    else:
        qc["expert_dtype"] = "fp4"
    cfg["quantization_config"] = qc
    save_checkpoint(path, out, cfg, shard_of)
    return out


def save_checkpoint(path, tensors, cfg, shard_of=None):
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if shard_of is None:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return
    files: dict[str, dict] = {}
    for name, t in tensors.items():
        files.setdefault(shard_of(name), {})[name] = t.contiguous()
    for file, part in files.items():
        save_file(part, os.path.join(path, file))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: shard_of(k) for k in tensors}}, f)


def by_block(name: str) -> str:
    """One shard per decoder layer's non-expert tensors, one per (layer, expert), one for MTP, one for the rest."""
    p = name.split(".")
    if p[0] == "layers":
        if p[3:4] == ["experts"]:
            return f"layer{p[1]}-expert{p[4]}.safetensors"
        return f"layer{p[1]}.safetensors"
    return "mtp.safetensors" if p[0] == "mtp" else "top.safetensors"


def expected_state(model, written, convention, block):
    """The state_dict a loader must produce: transformers' dequantization of what was written (fp32)."""
    out = {}
    scale_of = {}
    for name in written:
        if convention == "reference" and name.endswith(".scale") and name[:-5] + "weight" in written:
            scale_of[name[:-5] + "weight"] = name
        if convention == "hf" and name.endswith("_scale_inv"):
            scale_of[name[: -len("_scale_inv")]] = name
    for name, t in written.items():
        if name in scale_of.values():
            continue
        if name in scale_of:
            s = written[scale_of[name]]
            t = hf_fp8(t, s, block) if t.dtype == torch.float8_e4m3fn else hf_mxfp4(t, s)
        out[name] = t.float()
    if convention == "reference":
        from csattn.models.deepseek_v4.names import to_internal

        return to_internal(out)
    return out


# ------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("scale_kind", ["fp32", "e8m0", "u8"])
def test_fp8_dequant_equals_transformers_and_bounds_the_error(scale_kind):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 72, generator=g) * torch.logspace(-3, 1, 72)  # ragged in both dims; wide dynamic range
    block = (16, 32)
    q, s = quantize_fp8(w, block, scale_kind)
    ours = dequantize_fp8(q, s, block, torch.float32, "w")
    assert torch.equal(ours, hf_fp8(q, s, block))
    err = (ours - w).abs()
    assert (err <= fp8_bound(w, s, block)).all()
    assert err.max() > 0  # the quantizer did round
    # the bf16 result is the fp32 one rounded once
    assert torch.equal(dequantize_fp8(q, s, block, torch.bfloat16, "w"), ours.to(torch.bfloat16))
    # a whole-block shape also through transformers' checkpoint-loading dequantizer (uint8 scales included)
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    q2, s2 = quantize_fp8(w[:32, :64], block, scale_kind)
    assert torch.equal(dequantize_fp8(q2, s2, block), Fp8Dequantize(None)._dequantize_one(q2, s2, torch.float32))
    # 3-D (stacked experts): each expert its own block grid
    q3, s3 = zip(*(quantize_fp8(w[i:i + 20], block, scale_kind) for i in (0, 20)))
    q3, s3 = torch.stack(q3), torch.stack(s3)
    assert torch.equal(dequantize_fp8(q3, s3, block), hf_fp8(q3, s3, block))


@pytest.mark.parametrize("scale_kind", ["e8m0", "u8"])
def test_mxfp4_dequant_equals_transformers_and_bounds_the_error(scale_kind):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 96, generator=g) * torch.logspace(-2, 1, 96)
    q, s = quantize_mxfp4(w, scale_kind)
    ours = dequantize_mxfp4(q, s, torch.float32, "w")
    assert torch.equal(ours, hf_mxfp4(q, s))
    # gpt-oss layout: blocks [E, N, G, 16 bytes], uint8 exponents [E, N, G]; output transposed [E, K, N]
    s_u8 = s if s.dtype == torch.uint8 else s.view(torch.uint8)
    gpt = convert_moe_packed_tensors(q.view(torch.uint8).view(1, 6, 3, 16), s_u8.view(1, 6, 3), dtype=torch.float32)
    assert torch.equal(ours, gpt[0].T)
    err = (ours - w).abs()
    assert (err <= fp4_bound(w, s)).all() and err.max() > 0
    # the nibble order matters: decoding high nibble first breaks the bound
    u8 = q.view(torch.uint8)
    swapped = ((u8 << 4) | (u8 >> 4)).view(torch.int8)
    assert not (dequantize_mxfp4(swapped, s) - w).abs().le(fp4_bound(w, s)).all()
    # every byte: value table and order (low nibble = even column) as transformers unpacks them
    every = torch.arange(256, dtype=torch.uint8).view(8, 32)
    ones = torch.full((8, 2), 127, dtype=torch.uint8)
    table = torch.tensor(E2M1_VALUES)
    assert torch.equal(dequantize_mxfp4(every, ones), hf_mxfp4(every, ones))
    assert torch.equal(dequantize_mxfp4(every, ones).view(256, 2), torch.stack([table.repeat(16),
                                                                                   table.repeat_interleave(16)], -1))


@pytest.mark.parametrize("convention", ["reference", "hf"])
def test_load_quantized_checkpoint(tmp_path, convention):
    model = tiny(seed=3, mtp=1)
    # reference: the release's layout (ue8m0 e8m0 scales, small blocks so tensors span several ragged blocks);
    # hf: fp32 FP8 scales with the release's [128, 128] blocks (one ragged block), uint8 expert exponents
    block = (16, 16) if convention == "reference" else (128, 128)
    scale_kind = "e8m0" if convention == "reference" else "fp32"
    written = write_quantized(model, tmp_path, convention=convention, block=block, scale_kind=scale_kind,
                              expert_scale="e8m0" if convention == "reference" else "u8")
    loaded = load_pretrained(str(tmp_path))
    assert len(loaded.mtp) == 1
    report = loaded.load_report
    n_quant = sum(1 for k in written if k.endswith("_scale_inv") or (k.endswith(".scale") and k[:-5] + "weight"
                                                                      in written))
    assert report.dequantized >= n_quant > 0 and not report.skipped and not report.fresh

    # (a) every tensor equals transformers' dequantization of what was written
    want = expected_state(model, written, convention, block)
    got = loaded.state_dict()
    assert set(want) | {"lm_head.weight"} >= set(got) and set(want) <= set(got)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    # (b) and the original weights within the quantization error
    orig = model.state_dict()
    for name, w in orig.items():
        kind = kind_of(name)
        if kind == "fp8":
            s = _scale_for(written, name, convention)
            assert ((got[name] - w).abs() <= fp8_bound(w, s, block)).all(), name
        elif kind == "fp4":
            gate_up = name.endswith("gate_up_proj")
            for e in range(w.shape[0]):
                for half, wname in ((0, "w1"), (1, "w3")) if gate_up else ((None, "w2"),):
                    ref = w[e] if half is None else w[e].chunk(2)[half]
                    val = got[name][e] if half is None else got[name][e].chunk(2)[half]
                    s = _expert_scale(written, name, e, wname, half, convention)
                    assert ((val - ref).abs() <= fp4_bound(ref, s)).all(), (name, e, wname)
        elif kind == "bf16":
            assert torch.equal(got[name], w.to(torch.bfloat16).float()), name
        elif w.is_floating_point() or name.endswith("tid2eid"):
            assert torch.equal(got[name], w), name

    # (c) it trains: forward, loss, backward; also loaded straight into bf16
    ids = torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(0))
    packed = PackedSeqs.from_lengths([10, 14])
    out = loaded(ids, packed=packed, labels=torch.roll(ids, -1))
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in loaded.model.layers[2].parameters()
               if p.requires_grad)
    bf = load_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert bf.model.layers[0].self_attn.q_b_proj.weight.dtype == torch.bfloat16
    assert bf.model.layers[0].attn_hc.fn.dtype == torch.float32
    assert torch.equal(bf.model.layers[0].self_attn.q_b_proj.weight,
                       got["model.layers.0.self_attn.q_b_proj.weight"].to(torch.bfloat16))
    with torch.no_grad():
        assert torch.isfinite(bf(ids, packed=packed).logits.float()).all()


def _scale_for(written, name, convention):
    if convention == "hf":
        return written[name + "_scale_inv"]
    disk = to_disk({name: torch.zeros(1)})
    (key,) = disk
    return written[key.removeprefix("model.")[: -len("weight")] + "scale"]


def _expert_scale(written, name, e, wname, half, convention):
    if convention == "hf":
        s = written[name + "_scale_inv"][e]
        return s if half is None else s.chunk(2)[half]
    base = name.rsplit(".", 1)[0].replace("model.", "", 1).replace(".mlp.", ".ffn.")
    return written[f"{base}.{e}.{wname}.scale"]


def _counting_open(monkeypatch):
    import safetensors

    opened: list[str] = []
    real = safetensors.safe_open

    def counting(file, *args, **kwargs):
        opened.append(os.path.basename(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counting)
    return opened


def test_partial_loads_read_only_the_needed_shards(tmp_path, monkeypatch):
    model = tiny(seed=4, mtp=1)
    write_quantized(model, tmp_path, convention="reference", shard_of=by_block)
    shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    opened = _counting_open(monkeypatch)
    full = load_pretrained(str(tmp_path)).state_dict()
    assert sorted(opened) == shards  # each shard once

    # a middle pipeline stage: layers 1-2 only; neither the embedding, the head nor the MTP block
    opened.clear()
    stage = load_pretrained(str(tmp_path), layers=range(1, 3), dtype=torch.float32)
    assert sorted(opened) == sorted(f for f in shards if f.startswith(("layer1", "layer2")))
    assert stage.load_report.layers == [1, 2] and stage.load_report.top == [] and stage.load_report.mtp == []
    for i in (0, 3):
        assert all(p.is_meta for p in stage.model.layers[i].parameters())
    assert stage.model.embed_tokens.weight.is_meta and stage.lm_head.weight.is_meta
    for name, t in stage.state_dict().items():
        if name.startswith(("model.layers.1.", "model.layers.2.")):
            assert torch.equal(t, full[name]), name
        else:
            assert t.is_meta, name

    # the last stage: layer 3, head, MTP block and (for the MTP block's next-token embedding) the embedding
    opened.clear()
    last = load_pretrained(str(tmp_path), layers=[3])
    assert sorted(opened) == sorted(f for f in shards if f.startswith(("layer3", "top", "mtp")))
    assert len(last.mtp) == 1 and not last.mtp[0].e_proj.weight.is_meta
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.hc_head.hc_fn", "mtp.0.e_proj.weight"):
        assert torch.equal(last.state_dict()[name], full[name]), name

    # an expert-parallel rank holding expert 1 of layer 2: the other experts' shards stay closed
    opened.clear()
    ep = load_pretrained(str(tmp_path), layers=[2], filter=experts_filter([1]))
    assert sorted(opened) == ["layer2-expert1.safetensors", "layer2.safetensors"]
    gu, dn = "model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"
    got = ep.state_dict()
    assert torch.equal(got[gu][1], full[gu][1]) and torch.equal(got[dn][1], full[dn][1])
    assert not torch.equal(got[gu][0], full[gu][0])  # left at init
    skipped = set(ep.load_report.skipped)
    assert "model.layers.2.mlp.experts.0.w1.weight" in skipped and "model.layers.2.mlp.experts.1.w2.weight" \
        not in skipped and len(skipped) == 3 * 3
    wq_a = "model.layers.2.self_attn.q_a_proj.weight"
    assert torch.equal(got[wq_a], full[wq_a])


def test_scale_in_another_shard_and_hf_names_sharded(tmp_path, monkeypatch):
    model = tiny(seed=5, mtp=0, tie=True)

    def shard(name):  # layer 1's wq_a scale lands in layer 2's shard
        return "layer2.safetensors" if name == "model.layers.1.self_attn.q_a_proj.weight_scale_inv" else \
            f"layer{name.split('.')[2]}.safetensors" if name.startswith("model.layers.") else "top.safetensors"

    write_quantized(model, tmp_path, convention="hf", shard_of=shard)
    full = load_pretrained(str(tmp_path)).state_dict()
    opened = _counting_open(monkeypatch)
    one = load_pretrained(str(tmp_path), layers=[1])
    assert sorted(opened) == ["layer1.safetensors", "layer2.safetensors"]
    name = "model.layers.1.self_attn.q_a_proj.weight"
    assert torch.equal(one.state_dict()[name], full[name])
    # tied head: the last stage builds the embedding its head is
    opened.clear()
    last = load_pretrained(str(tmp_path), layers=[3])
    assert last.lm_head.weight is last.model.embed_tokens.weight and not last.lm_head.weight.is_meta
    assert sorted(opened) == ["layer3.safetensors", "top.safetensors"]


def test_bad_checkpoints_name_the_tensor_or_field(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny(seed=6, mtp=0)
    write_quantized(model, tmp_path, convention="reference")
    weights, config = os.path.join(tmp_path, "model.safetensors"), os.path.join(tmp_path, "config.json")
    tensors = load_file(weights)
    with open(config) as f:
        raw = json.load(f)

    def rewrite(t=None, cfg=None):
        save_file(t if t is not None else tensors, weights)
        with open(config, "w") as f:
            json.dump(cfg if cfg is not None else raw, f)

    key = "layers.0.attn.wq_b.scale"
    bad = dict(tensors)
    bad[key] = bad[key][:-1]
    rewrite(bad)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_b\.weight.*scale has shape"):
        load_pretrained(str(tmp_path))
    # a block size the scales do not fit names the config field to check
    rewrite(cfg={**raw, "quantization_config": {**raw["quantization_config"], "weight_block_size": [32, 32]}})
    with pytest.raises(ValueError, match="weight_block_size"):
        load_pretrained(str(tmp_path))
    rewrite(cfg={**raw, "quantization_config": {**raw["quantization_config"], "quant_method": "awq"}})
    with pytest.raises(ValueError, match=r"quant_method is 'awq'"):
        load_pretrained(str(tmp_path))
    rewrite(cfg={**raw, "quantization_config": {**raw["quantization_config"], "weight_block_size": [128]}})
    with pytest.raises(ValueError, match=r"weight_block_size must be two positive ints"):
        load_pretrained(str(tmp_path))
    rewrite(cfg={**raw, "expert_dtype": "fp8"})
    with pytest.raises(ValueError, match=r"ffn\.experts\.\d+\.w\d\.weight.*expert_dtype"):
        load_pretrained(str(tmp_path))
    rewrite(cfg={k: v for k, v in raw.items() if k != "quantization_config"})
    with pytest.raises(ValueError, match=r"has a scale .* no quantization_config"):
        load_pretrained(str(tmp_path))
    no_scale = {k: v for k, v in tensors.items() if k != "layers.1.attn.wo_b.scale"}
    rewrite(no_scale, raw)
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.wo_b\.weight.*no scale"):
        load_pretrained(str(tmp_path))
    rewrite(tensors, raw)
    with pytest.raises(ValueError, match=r"layers= holds \[7\]"):
        load_pretrained(str(tmp_path), layers=[1, 7])
    assert math.isfinite(float(load_pretrained(str(tmp_path), layers=[0]).model.embed_tokens.weight.detach().sum()))


def test_train_init_from_a_quantized_release(tmp_path):
    """``csattn train --init-from`` takes a release checkpoint as it is: its first step starts from the
    dequantized weights (those load_pretrained gives) and trains."""
    from csattn.train.run import TrainConfig, train

    model = tiny(seed=5, mtp=1)
    write_quantized(model, tmp_path / "release", convention="reference")
    want = load_pretrained(str(tmp_path / "release")).state_dict()
    got = train(TrainConfig(init_from=str(tmp_path / "release"), steps=1, seq_len=64, lr=0.0, min_lr=0.0,
                            warmup_steps=1, weight_decay=0.0, router_bias_rate=0.0, device="cpu", progress=False))
    assert torch.isfinite(torch.tensor(got.losses)).all()
    for k, v in want.items():  # lr 0: the weights after the step are the loaded ones
        assert torch.equal(got.model.state_dict()[k], v), k
