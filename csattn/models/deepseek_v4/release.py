"""Synthetic checkpoints in the release's format, for tests and benchmarks: FP8 e4m3 dense linears with ue8m0 (or
fp32) scales per ``[bn, bk]`` block, MXFP4 routed experts (e2m1 pairs, one ue8m0 scale per 32), the compressor /
indexer projections in bf16, everything else as the model holds it; DeepSeek's reference names (``layers.{i}.attn
.wq_b.weight`` + ``.scale``, per-expert ``ffn.experts.{e}.w1.weight``) and a ``config.json`` with the release's
``quantization_config`` and top-level ``expert_dtype: "fp4"``.

:func:`write_release_checkpoint` draws the weights one unit at a time (the model's own initialization, each decoder
layer from its own seed) and writes one shard per unit, so a full-size geometry never lives in memory at once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from ...ops.fp8 import FP8_MAX
from .config import DeepseekV4ModelConfig
from .model import DecoderLayer, MTPBlock, TopParts, draw_unit
from .names import internal_name, to_disk
from .quant import E2M1_VALUES, MXFP4_GROUP

__all__ = ["quantize_fp8_blocks", "quantize_mxfp4", "release_kind", "write_release_checkpoint"]

# the release stores these as FP8 blocks (suffixes of state_dict names) ...
FP8_LINEARS = ("q_a_proj.weight", "q_b_proj.weight", "self_attn.kv_proj.weight", "o_a_proj.weight",
               "o_b_proj.weight", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
               "shared_experts.down_proj.weight", "e_proj.weight", "h_proj.weight")
# ... and these in bf16 (compressor, indexer-compressor and indexer-weights projections)
BF16_LINEARS = ("compressor.kv_proj.weight", "compressor.gate_proj.weight", "indexer.kv_proj.weight",
                "indexer.gate_proj.weight", "scorer.weights_proj.weight")
_E2M1_MAGS = torch.tensor(E2M1_VALUES[:8])


def release_kind(name: str) -> str:
    """How the release stores ``state_dict`` tensor ``name``: ``"fp4"``, ``"fp8"``, ``"bf16"`` or ``"keep"``."""
    if ".mlp.experts." in name:
        return "fp4"
    if name.endswith(BF16_LINEARS):
        return "bf16"
    if name.endswith(FP8_LINEARS):
        return "fp8"
    return "keep"


def _store_scale(s: Tensor, kind: str) -> Tensor:
    if kind == "fp32":
        return s.float()
    if kind == "e8m0":
        return s.to(torch.float8_e8m0fnu)  # exact: s is a power of two
    return (torch.log2(s).round() + 127).to(torch.uint8)


def quantize_fp8_blocks(w: Tensor, block: tuple[int, int] = (128, 128),
                        scale_kind: str = "e8m0") -> tuple[Tensor, Tensor]:
    """``w [N, K]`` -> e4m3 ``[N, K]`` and one scale per block ``[ceil(N/bn), ceil(K/bk)]``: ``amax / 448`` as fp32
    (``scale_kind="fp32"``) or the power of two at or above it, stored as ``float8_e8m0fnu`` (``"e8m0"``) or biased
    exponent bytes (``"u8"``)."""
    bn, bk = block
    n, k = w.shape
    r, c = -(-n // bn), -(-k // bk)
    pad = w.new_zeros(r * bn, c * bk, dtype=torch.float32)
    pad[:n, :k] = w
    blocks = pad.view(r, bn, c, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if scale_kind != "fp32":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(r * bn, c * bk)
    return q[:n, :k].contiguous(), _store_scale(s, scale_kind)


def quantize_mxfp4(w: Tensor, scale_kind: str = "e8m0",
                   packed_dtype: torch.dtype = torch.int8) -> tuple[Tensor, Tensor]:
    """``w [N, K]`` (K even) -> packed e2m1 pairs ``[N, K/2]`` (low nibble = even column) and ue8m0 scales
    ``[N, ceil(K/32)]`` (the smallest power of two that maps each group's amax into [-6, 6]; nearest e2m1)."""
    n, k = w.shape
    g = -(-k // MXFP4_GROUP)
    pad = w.new_zeros(n, g * MXFP4_GROUP, dtype=torch.float32)
    pad[:, :k] = w
    groups = pad.view(n, g, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1)
    s = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / 6.0))), torch.ones_like(amax))
    v = (groups / s[..., None]).view(n, g * MXFP4_GROUP)[:, :k]
    idx = (v.abs()[..., None] - _E2M1_MAGS.to(v.device)).abs().argmin(dim=-1)  # nearest e2m1 magnitude
    nib = (idx + 8 * (v < 0).long()).to(torch.uint8)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous()
    return packed.view(packed_dtype), _store_scale(s, scale_kind)


def _quantized(state: dict[str, Tensor], block: tuple[int, int], scale_kind: str) -> dict[str, Tensor]:
    """``state_dict`` tensors of one unit -> the release's tensors (reference names, no ``model.`` prefix)."""
    out: dict[str, Tensor] = {}
    for name, t in to_disk(state).items():
        name = name.removeprefix("model.")
        kind = release_kind(internal_name(name))
        if kind == "bf16":
            out[name] = t.to(torch.bfloat16)
        elif kind == "fp8":
            out[name], out[name[: -len("weight")] + "scale"] = quantize_fp8_blocks(t, block, scale_kind)
        elif kind == "fp4":
            out[name], out[name[: -len("weight")] + "scale"] = quantize_mxfp4(t, "e8m0")
        else:
            out[name] = t.contiguous()
    return out


Draw = Callable[[int, Callable[[], nn.Module]], dict[str, Tensor]]


def _units(c: DeepseekV4ModelConfig, draw: Draw,
           experts: range | None = None) -> Iterator[tuple[str, dict[str, Tensor]]]:
    """``(shard name, state_dict)`` of each unit, drawn one at a time: ``draw(index, make)`` builds unit ``index``
    with ``make`` and returns its tensors; ``experts``: the routed experts the blocks build (default all)."""
    local = () if experts is None else (experts,)
    top = draw(0, lambda: TopParts(c))
    yield "model-top.safetensors", {k: v for k, v in top.items() if k != "lm_head.weight"
                                    or not c.tie_word_embeddings}
    for i in range(c.num_hidden_layers):
        layer = draw(1 + i, lambda i=i: DecoderLayer(c, i, *local))
        yield f"model-layer{i:05d}.safetensors", {f"model.layers.{i}.{k}": v for k, v in layer.items()}
    for j in range(c.num_nextn_predict_layers):
        block = draw(1 + c.num_hidden_layers + j, lambda j=j: MTPBlock(c, j, *local))
        yield f"model-mtp{j:02d}.safetensors", {f"mtp.{j}.{k}": v for k, v in block.items()}


def _model_draw(seed: int) -> Draw:
    """Each unit from the model's own generators on the host (the values ``csattn.parallel.materialize`` gives)."""
    return lambda index, make: draw_unit(seed, index, make).state_dict()


def _device_draw(c: DeepseekV4ModelConfig, seed: int, device: torch.device) -> Draw:
    """Each unit drawn on ``device`` (build its blocks without experts: ``_units(..., experts=range(0))``): its
    modules' own initialization run there (from the device's generator, seeded per unit) and each block's routed
    experts drawn whole, ``normal(0, 0.02)`` as ``Experts`` draws them, from a generator on ``device``: the model's
    scales, not its values."""
    devices = [device.index or 0] if device.type == "cuda" else []

    def draw(index: int, make: Callable[[], nn.Module]) -> dict[str, Tensor]:
        with torch.random.fork_rng(devices=devices), torch.device(device):
            torch.manual_seed(seed * 1_000_003 + index)
            module = make()
        if isinstance(module, DecoderLayer):  # the table the model draws (on the host: its generator's)
            module.mlp.gate.init_hash_table(torch.Generator().manual_seed(seed * 1_000_003 + index))
        state = module.state_dict()
        if isinstance(module, (DecoderLayer, MTPBlock)):
            gen = torch.Generator(device).manual_seed(seed * 1_000_003 + index)
            e, i, d = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
            for name, shape in (("gate_up_proj", (e, 2 * i, d)), ("down_proj", (e, d, i))):
                state[f"mlp.experts.{name}"] = torch.empty(shape, device=device).normal_(0.0, 0.02, generator=gen)
        return state

    return draw


def write_release_checkpoint(config: DeepseekV4ModelConfig, path: str, seed: int = 0,
                             block: tuple[int, int] = (128, 128), scale_kind: str = "e8m0",
                             device: torch.device | str = "cpu", draw: str = "model") -> dict[str, str]:
    """Write a random model of ``config``'s geometry as the release stores it (see the module docstring).

    Args:
        config: the geometry (e.g. ``DeepseekV4ModelConfig.from_hf(json.load(open("benchmarks/v4_flash.json")))``).
        path: output directory (created): ``config.json``, one ``model-*.safetensors`` per unit,
            ``model.safetensors.index.json``.
        seed: the weights' seed (each unit drawn from its own, as ``csattn.parallel.materialize`` does).
        block: the dense FP8 block ``[bn, bk]`` (the release's ``[128, 128]``).
        scale_kind: the dense scales' storage: ``"e8m0"`` (the release's), ``"u8"`` or ``"fp32"``.
        device: where each unit is quantized (the same bytes anywhere; a GPU takes a full-width layer's experts in
            seconds, the CPU in minutes).
        draw: ``"model"``: the weights drawn on the CPU from the model's own generators (the values
            ``csattn.parallel.materialize`` gives; about 45 s a full-width layer); ``"device"``: drawn on ``device``
            from generators seeded per unit (the same initializations, so the same scales, other values; seconds a
            layer on a GPU), for benchmarks that need a realistic checkpoint, not particular values.

    Returns:
        The index's ``weight_map`` (on-disk name -> shard).
    """
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    weight_map: dict[str, str] = {}
    if draw not in ("model", "device"):
        raise ValueError(f"draw must be 'model' or 'device', got {draw!r}")
    units = _units(config, _model_draw(seed)) if draw == "model" else \
        _units(config, _device_draw(config, seed, torch.device(device)), experts=range(0))
    for shard, state in units:
        tensors = _quantized({k: v.to(device) for k, v in state.items()}, block, scale_kind)
        tensors = {k: v.cpu() for k, v in tensors.items()}
        save_file(tensors, os.path.join(path, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        del state, tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
    cfg = config.to_hf_dict()
    cfg["num_nextn_predict_layers"] = config.num_nextn_predict_layers
    cfg["expert_dtype"] = "fp4"
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
                                  "activation_scheme": "dynamic",
                                  "scale_fmt": None if scale_kind == "fp32" else "ue8m0"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    return weight_map

