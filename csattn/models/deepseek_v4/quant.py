"""Dequantizers for the released DeepSeek-V4 checkpoints (what ``load_pretrained`` reads).

The release stores (``config.json`` ``quantization_config``: ``quant_method: "fp8"``, ``fmt: "e4m3"``,
``weight_block_size: [128, 128]``, ``scale_fmt: "ue8m0"``, ``expert_dtype: "fp4"``):

* dense linears as FP8 e4m3 (``torch.float8_e4m3fn``) ``[..., N, K]`` with one scale per ``[bn, bk]`` block,
  ``scale [..., ceil(N / bn), ceil(K / bk)]`` (the last block row / column is ragged when ``bn`` / ``bk`` does not
  divide the dimension); ``w = q * scale[n // bn, k // bk]``. The scale companion is ``<name>.scale`` in DeepSeek's
  reference names and ``<name>.weight_scale_inv`` (``<param>_scale_inv`` for fused experts) in HF's;
  despite HF's "inv" it multiplies;
* routed experts as MXFP4: two e2m1 values per byte ``[..., N, K / 2]`` (int8 / uint8 / ``float4_e2m1fn_x2``),
  the **low** nibble holding the even column ``k = 2j``, the high nibble ``k = 2j + 1``; nibble bit 3 is the sign
  and bits 0-2 index ``E2M1_VALUES``; one scale per 32 values along K, ``scale [..., N, ceil(K / 32)]``;
* scales as fp32, or ue8m0 (8-bit exponent only, value ``2 ** (byte - 127)``, byte 255 = NaN) stored as
  ``torch.float8_e8m0fnu`` or raw ``uint8``.

The same conventions as ``transformers``' fine-grained FP8 integration (``Fp8Dequantize``,
``_dequantize_fp8_weight``) and its MXFP4 unpacking (``convert_moe_packed_tensors``); the products are formed in
fp32 as there, so the results equal theirs bit for bit (tests/models/test_quantized_checkpoint.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...layers.modules import grouped_linear
from ...ops.backend import BackendChoice
from ...ops.fp8 import BLOCK, COMPUTES, check_compute, dequantize, fp8_linear
from .moe import Experts

__all__ = ["E2M1_VALUES", "FP8_BLOCK", "MXFP4_GROUP", "QuantConfig", "decode_scale", "dequantize_fp8",
           "dequantize_mxfp4", "is_fp4_packed", "is_fp8", "mxfp4_to_fp8", "COMPUTES", "Fp8Linear", "Fp8Experts",
           "hold_in_fp8"]

# e2m1 magnitudes indexed by the nibble's low 3 bits; bit 3 is the sign (so index 8 is -0.0)
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values per ue8m0 scale along K (the OCP MX block size)

_FP4_X2 = getattr(torch, "float4_e2m1fn_x2", None)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
# rows dequantized per step: bounds the fp32 temporaries of one large tensor (e.g. wq_b [65536, 1536])
_CHUNK_ELEMS = 1 << 24


def is_fp8(t: Tensor) -> bool:
    """Whether ``t`` holds FP8 e4m3 values (the release's dense linears)."""
    return t.dtype == torch.float8_e4m3fn


def is_fp4_packed(t: Tensor) -> bool:
    """Whether ``t`` can hold packed e2m1 pairs (int8 / uint8 bytes or ``float4_e2m1fn_x2``)."""
    return t.dtype in (torch.int8, torch.uint8) or (_FP4_X2 is not None and t.dtype == _FP4_X2)


@dataclass(frozen=True)
class QuantConfig:
    """The ``quantization_config`` of a ``config.json`` that ``load_pretrained`` can dequantize."""

    block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "float"
    expert_dtype: str = "fp8"

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> QuantConfig | None:
        """``None`` when the config has no ``quantization_config``; ``ValueError`` naming the field when it is
        one this loader cannot read (another ``quant_method``, a non-e4m3 ``fmt``, static activation scales...)."""
        qc = raw.get("quantization_config")
        if qc is None:
            return None
        if not isinstance(qc, dict):
            raise ValueError(f"config.json quantization_config must be an object, got {type(qc).__name__}")
        method = qc.get("quant_method")
        if method != "fp8":
            raise ValueError(f"config.json quantization_config.quant_method is {method!r}: load_pretrained reads "
                             "'fp8' (FP8 e4m3 block-scaled linears, optionally MXFP4 experts, as DeepSeek-V4 is "
                             "released); dequantize this checkpoint to bf16/fp32 first")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"config.json quantization_config.fmt is {fmt!r}: only 'e4m3' "
                             "(torch.float8_e4m3fn) weights are supported")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"config.json quantization_config.activation_scheme is {qc['activation_scheme']!r}: "
                             "only 'dynamic' is supported (static activation scales have no meaning in training)")
        block = qc.get("weight_block_size", [128, 128])
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"config.json quantization_config.weight_block_size must be two positive ints "
                             f"[block_n, block_k], got {block!r}")
        scale_fmt = qc.get("scale_fmt") or "float"
        if scale_fmt not in ("float", "ue8m0"):
            raise ValueError(f"config.json quantization_config.scale_fmt is {scale_fmt!r}: expected 'ue8m0' or "
                             "'float'")
        # the release puts expert_dtype at the top level; transformers moves it into quantization_config
        expert = qc.get("expert_dtype", raw.get("expert_dtype")) or "fp8"
        if expert not in ("fp8", "fp4"):
            raise ValueError(f"config.json expert_dtype is {expert!r}: expected 'fp4' (MXFP4 experts) or 'fp8'")
        return cls(block_size=(int(block[0]), int(block[1])), scale_fmt=scale_fmt, expert_dtype=expert)


def _ue8m0_bytes(scale: Tensor, name: str, check: bool = True) -> Tensor | None:
    """The bytes of a ue8m0 ``scale`` (``float8_e8m0fnu`` or ``uint8``), None for another dtype. ``check``: a
    ``ValueError`` naming ``name`` for byte 255 (NaN; reads the values: a host sync)."""
    if scale.dtype != torch.uint8 and (_E8M0 is None or scale.dtype != _E8M0):
        return None
    byte = scale.view(torch.uint8)
    if check and bool((byte == 255).any()):
        raise ValueError(f"tensor {name!r}: ue8m0 scale byte 255 (NaN); the checkpoint is corrupt")
    return byte


def decode_scale(scale: Tensor, name: str = "scale", check: bool = True) -> Tensor:
    """Scale values as fp32 (same shape): ue8m0 (``float8_e8m0fnu`` or ``uint8`` bytes) -> ``2 ** (byte - 127)``,
    floats as they are. ``ValueError`` naming ``name`` for other dtypes or (``check``) ue8m0 NaN (byte 255)."""
    byte = _ue8m0_bytes(scale, name, check)
    if byte is not None:
        # exp2 of an integer in [-127, 127] is exact in fp32 (2**-127 is a subnormal)
        return torch.exp2(byte.to(torch.float32) - 127.0)
    if scale.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        return scale.to(torch.float32)
    raise ValueError(f"tensor {name!r}: scale dtype {scale.dtype} is neither fp32 nor ue8m0 "
                     "(float8_e8m0fnu / uint8)")


def _row_chunk(rows: int, cols: int, multiple: int) -> int:
    step = max(1, _CHUNK_ELEMS // max(1, cols)) // multiple * multiple
    return max(multiple, step)


def dequantize_fp8(weight: Tensor, scale: Tensor, block_size: tuple[int, int], dtype: torch.dtype = torch.float32,
                   name: str = "weight") -> Tensor:
    """FP8 e4m3 block dequantization.

    Args:
        weight: ``[..., N, K]`` ``float8_e4m3fn``.
        scale: ``[..., ceil(N / bn), ceil(K / bk)]`` fp32 or ue8m0; block ``(r, c)`` covers rows
            ``r*bn:(r+1)*bn`` and columns ``c*bk:(c+1)*bk`` (the last ones ragged).
        block_size: ``(bn, bk)``, the config's ``weight_block_size``.
        dtype: output dtype; each value is ``q * s`` formed in fp32, then rounded once to ``dtype``.
        name: the tensor's name, for errors.

    Returns:
        ``[..., N, K]`` in ``dtype``.
    """
    if not is_fp8(weight):
        raise ValueError(f"tensor {name!r} has dtype {weight.dtype}; an FP8 block-scaled weight must be "
                         "torch.float8_e4m3fn")
    if weight.dim() < 2:
        raise ValueError(f"tensor {name!r} has shape {tuple(weight.shape)}; an FP8 weight is at least 2-D")
    bn, bk = block_size
    n, k = weight.shape[-2:]
    want = (*weight.shape[:-2], -(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"tensor {name!r}: scale has shape {tuple(scale.shape)} but weight {tuple(weight.shape)} "
                         f"with weight_block_size [{bn}, {bk}] needs {want} (ceil(N/{bn}), ceil(K/{bk})); is the "
                         "config's weight_block_size the checkpoint's?")
    s = decode_scale(scale, name)
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    step = _row_chunk(n, k, bn)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        # expand this chunk's scales to [.., r1-r0, K]: rows then columns, cut to the ragged edges
        sc = s[..., r0 // bn: -(-r1 // bn), :].repeat_interleave(bn, dim=-2)[..., : r1 - r0, :]
        sc = sc.repeat_interleave(bk, dim=-1)[..., :k]
        out[..., r0:r1, :] = (weight[..., r0:r1, :].to(torch.float32) * sc).to(dtype)
    return out


def _check_mxfp4(packed: Tensor, scale: Tensor, name: str) -> tuple[int, int, int]:
    """``(N, K / 2, K)`` of a packed MXFP4 weight ``[..., N, K / 2]``; a ``ValueError`` naming ``name`` for a
    wrong dtype, fewer than 2 dimensions, or scales not ``[..., N, ceil(K / 32)]``."""
    if not is_fp4_packed(packed):
        raise ValueError(f"tensor {name!r} has dtype {packed.dtype}; MXFP4 weights are packed e2m1 pairs "
                         "(int8 / uint8 / float4_e2m1fn_x2)")
    if packed.dim() < 2:
        raise ValueError(f"tensor {name!r} has shape {tuple(packed.shape)}; an MXFP4 weight is at least 2-D")
    n, half = packed.shape[-2:]
    k = 2 * half
    want = (*packed.shape[:-1], -(-k // MXFP4_GROUP))
    if tuple(scale.shape) != want:
        raise ValueError(f"tensor {name!r}: scale has shape {tuple(scale.shape)} but packed MXFP4 weight "
                         f"{tuple(packed.shape)} (K = {k}) needs {want} (one per {MXFP4_GROUP} values along K)")
    return n, half, k


def dequantize_mxfp4(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32,
                     name: str = "weight") -> Tensor:
    """MXFP4 dequantization (the release's routed experts).

    Args:
        packed: ``[..., N, K / 2]`` int8 / uint8 / ``float4_e2m1fn_x2``; byte ``j`` holds column ``2j`` in its low
            nibble and ``2j + 1`` in its high nibble.
        scale: ``[..., N, ceil(K / 32)]`` ue8m0 (or fp32), one per 32 consecutive values along K.
        dtype: output dtype (``e2m1 * 2**e`` is exact in fp32, then rounded once to ``dtype``).
        name: the tensor's name, for errors.

    Returns:
        ``[..., N, K]`` in ``dtype``.
    """
    n, _, k = _check_mxfp4(packed, scale, name)
    s = decode_scale(scale, name)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    u8 = packed.contiguous().view(torch.uint8)
    out = torch.empty((*packed.shape[:-1], k), dtype=dtype, device=packed.device)
    step = _row_chunk(n, k, 1)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        b = u8[..., r0:r1, :]
        vals = torch.stack([lut[(b & 0xF).long()], lut[(b >> 4).long()]], dim=-1).flatten(-2)  # low nibble first
        sc = s[..., r0:r1, :].repeat_interleave(MXFP4_GROUP, dim=-1)[..., :k]
        out[..., r0:r1, :] = (vals * sc).to(dtype)
    return out


# ------------------------------------------------------------------------------------- MXFP4 -> FP8, exactly
FP8_BLOCK = BLOCK  # rows and columns per scale of the FP8-held weights (the release's weight_block_size)
# e2m1 magnitude index i (1..7) as c * 2**q0 with c odd: 0.5, 1, 1.5, 2, 3, 4, 6
_E2M1_Q0 = (0, -1, 0, -1, 1, 0, 2, 1)
# the largest power of two that c * 2**q may reach in e4m3 (max 448 = 1.75 * 2**8): 8 for c = 1, 7 for c = 3
_E2M1_TOP = (0, 8, 8, 7, 8, 7, 8, 7)
# e4m3's finite values are multiples of its smallest subnormal 2**-9: an odd c times 2**q needs q >= -9
_E4M3_LOW = -9
_NONE = 1 << 12  # "no constraint" sentinel for exponent bounds (far outside every reachable exponent)


def _group_exponents(scale: Tensor, name: str) -> Tensor:
    """MXFP4 group scales -> their integer exponents (int32): ue8m0 bytes ``b`` give ``b - 127``; fp32 scales
    must be powers of two. ``ValueError`` naming ``name`` for byte 255 (NaN) or a scale that is not ``2**e``."""
    byte = _ue8m0_bytes(scale, name)
    if byte is not None:
        return byte.to(torch.int32) - 127
    s = decode_scale(scale, name)
    mant, exp = torch.frexp(s)
    if not bool((mant == 0.5).all()):
        raise ValueError(f"tensor {name!r}: MXFP4 group scales must be powers of two (ue8m0); this one holds "
                         "others, which FP8 with power-of-two block scales cannot reproduce")
    return exp - 1


def _byte_tables(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Per packed byte (two e2m1 codes): the tightest lower and upper bound its nonzero values put on the block
    exponent relative to their group's (``max(q0 - top)``, ``min(q0) + 9``; +-``_NONE`` for two zeros), and its two
    values as fp32 (low nibble first); on ``device``."""
    b = torch.arange(256, device=device)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1)  # [256, 2]
    mag = codes & 7
    q0, top = torch.tensor(_E2M1_Q0, device=device)[mag], torch.tensor(_E2M1_TOP, device=device)[mag]
    nonzero = mag > 0
    lo = torch.where(nonzero, q0 - top, -_NONE).amax(-1).to(torch.int16)
    hi = torch.where(nonzero, q0 - _E4M3_LOW, _NONE).amin(-1).to(torch.int16)
    return lo, hi, torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)[codes]


def _block_reduce(t: Tensor, groups_per_block: int, fill: int, largest: bool) -> Tensor:
    """``[..., N, G]`` per-group values -> ``[..., ceil(N/128), ceil(G/gpb)]`` max (or min) per 128-row block."""
    n, g = t.shape[-2:]
    r, c = -(-n // FP8_BLOCK), -(-g // groups_per_block)
    pad = t.new_full((*t.shape[:-2], r * FP8_BLOCK, c * groups_per_block), fill)
    pad[..., :n, :g] = t
    pad = pad.view(*t.shape[:-2], r, FP8_BLOCK, c, groups_per_block)
    return pad.amax(dim=(-3, -1)) if largest else pad.amin(dim=(-3, -1))


def mxfp4_to_fp8(packed: Tensor, scale: Tensor, name: str = "weight") -> tuple[Tensor, Tensor, Tensor]:
    """MXFP4 (e2m1 values, one power-of-two scale per 32 along K) re-expressed as FP8 e4m3 with one
    power-of-two fp32 scale per 128 x 128 block, exactly wherever e4m3 can hold the block.

    Each nonzero value is ``c * 2**q`` with ``c`` in {1, 3}; it is an e4m3 value times ``2**p`` iff
    ``q - p >= -9`` (e4m3's values are multiples of its smallest subnormal ``2**-9``) and ``c * 2**(q - p) <= 448``
    (``q - p <= 8`` for ``c = 1``, ``<= 7`` for ``c = 3``). A block is exact iff some ``p`` meets every value's
    bounds; the smallest such ``p`` is taken (the largest values as large as e4m3 allows). A block whose group
    scales lie too far apart (about ``2**14``: its smallest values then fall below ``2**-9 * 2**p``) has none:
    it gets the ``p`` of its largest values and its small values round to nearest (possibly to zero), and
    ``inexact`` flags it. All-zero blocks get scale 1.

    Args:
        packed: ``[..., N, K / 2]`` packed e2m1 pairs (see :func:`dequantize_mxfp4`).
        scale: ``[..., N, ceil(K / 32)]`` ue8m0 (``float8_e8m0fnu`` / ``uint8``) or power-of-two fp32.
        name: the tensor's name, for errors.

    Returns:
        ``(weight, scale, inexact)``: e4m3 ``[..., N, K]``; fp32 ``[..., ceil(N / 128), ceil(K / 128)]``;
        bool ``[..., ceil(N / 128), ceil(K / 128)]``, True where the block was rounded. Where ``inexact`` is
        False, ``dequantize_fp8(weight, scale, (128, 128))`` equals ``dequantize_mxfp4(packed, scale)`` bit for bit.
        On ``packed``'s device (``scale`` must be on it too): the same bytes on any device, in seconds on a GPU
        for a full-width expert matrix.

    Raises:
        ValueError: naming ``name`` for a wrong dtype or shape, ue8m0 byte 255 (NaN), non-power-of-two scales.
    """
    n, half, k = _check_mxfp4(packed, scale, name)
    exp = _group_exponents(scale, name).to(torch.int16)  # [..., N, G]
    g = exp.shape[-1]
    lo_of, hi_of, values_of = _byte_tables(packed.device)
    # the packed bytes by group, padded with zero bytes to whole groups: [..., N, G, 16]
    u8 = packed.contiguous().view(torch.uint8)
    if k < g * MXFP4_GROUP:
        u8 = torch.cat([u8, u8.new_zeros((*u8.shape[:-1], g * MXFP4_GROUP // 2 - half))], dim=-1)
    idx = u8.view(*u8.shape[:-1], g, MXFP4_GROUP // 2).to(torch.int32)
    # each group's admissible block exponents [lo, hi] (its values c * 2**q: q - p <= top and q - p >= -9)
    lo_g, hi_g = lo_of[idx].amax(dim=-1), hi_of[idx].amin(dim=-1)
    lo = torch.where(lo_g == -_NONE, -_NONE, exp + lo_g)
    hi = torch.where(hi_g == _NONE, _NONE, exp + hi_g)
    per_block = FP8_BLOCK // MXFP4_GROUP
    lo, hi = _block_reduce(lo, per_block, -_NONE, True), _block_reduce(hi, per_block, _NONE, False)
    empty = lo == -_NONE
    p = torch.where(empty, 0, lo)
    inexact = ~empty & (lo > hi)
    # each group's exponent under its block's scale; below -40 its values round to 0 either way, fp32 stays exact
    p_group = p.repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :].repeat_interleave(per_block, dim=-1)[..., :g]
    shift = torch.exp2((exp - p_group).clamp_(-40, 40).to(torch.float32))
    weight = (values_of[idx] * shift[..., None, None]).view(*exp.shape[:-1], g * MXFP4_GROUP)[..., :k]
    weight = weight.to(torch.float8_e4m3fn)
    # 2**p as fp32: exact from fp64 (p >= -136 > fp32's smallest subnormal exponent -149)
    block_scale = torch.exp2(p.to(torch.float64)).to(torch.float32)
    return weight, block_scale, inexact


# ------------------------------------------------------------------------------------- FP8-held frozen weights
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _frozen(shape: tuple[int, ...], device: torch.device | str | None) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device), requires_grad=False)


def _apply_raw(module: nn.Module, fn: Callable[[Tensor], Tensor], recurse: bool) -> None:
    """``nn.Module._apply`` with the module's ``frozen_storage`` travelling as raw bytes: ``model.to(dtype)``,
    ``.half()``, ``.cuda()``, ``to_empty`` move the codes and their scales but never cast them as floats (a cast
    of e4m3 codes would drop their scales; of the scales, round them)."""
    params, buffers = module._parameters, module._buffers
    kept = {}
    for name in module.frozen_storage:
        store = params if name in params else buffers
        t = store[name]
        kept[name] = t.dtype
        raw = t.detach().view(torch.uint8 if t.element_size() == 1 else torch.int32)
        store[name] = nn.Parameter(raw, requires_grad=False) if store is params else raw
    try:
        nn.Module._apply(module, fn, recurse)
    finally:
        for name, dtype in kept.items():
            store = params if name in params else buffers
            t = store[name].detach().view(dtype)
            store[name] = nn.Parameter(t, requires_grad=False) if store is params else t


class Fp8Linear(nn.Module):
    """A frozen linear held as the release stores it: ``weight`` e4m3 ``[N, K]`` (a parameter that does not
    require grad) and ``weight_scale_inv`` fp32 ``[ceil(N/128), ceil(K/128)]`` (HF's names: its ``state_dict``
    reads and writes the release's FP8 tensors as they are).

    The forward runs :func:`csattn.ops.fp8.fp8_linear` (differentiable in ``x``). ``module.weight`` is the weight
    dequantized to the compute dtype, a new tensor each time, for code that reads the weight itself (the
    attention core's ``q_b_proj`` / ``o_a_proj`` / ``o_b_proj``, the shared expert); ``named_parameters`` and the
    ``state_dict`` hold the e4m3 codes. The compute dtype follows ``model.to(dtype)`` and
    ``to_training_dtype``; the codes and scales never change dtype (:func:`_apply_raw`).

    Args:
        in_features, out_features: ``K``, ``N``.
        compute: ``"fp8"`` (activations quantized per 1x128 tile, FP8 tensor cores) or ``"w8a16"`` (the weight
            dequantized in the kernel, bf16 numerics).
        dtype: the compute dtype (the model's training dtype).
        groups: ``g > 1`` holds a block-diagonal projection (``GroupedLinear``'s ``[out, in_per_group]`` weight)
            whose forward maps ``x [T, g, K]``; it runs on the dequantized weight (the attention reads that
            weight itself).
    """

    frozen_storage = ("weight", "weight_scale_inv")

    def __init__(self, in_features: int, out_features: int, compute: str = "fp8",
                 dtype: torch.dtype = torch.bfloat16, groups: int = 1,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.compute = check_compute(compute)
        # set through _parameters: the class's `weight` is the dequantizing accessor
        self._parameters["weight"] = _frozen((out_features, in_features), device)
        self.register_buffer("weight_scale_inv", torch.ones(_cdiv(out_features, FP8_BLOCK),
                                                            _cdiv(in_features, FP8_BLOCK), device=device))
        # an empty tensor of the compute dtype: casts with the model, holds nothing, saves nothing
        self.register_buffer("dtype_tag", torch.empty(0, dtype=dtype, device=device), persistent=False)

    @property
    def weight(self) -> Tensor:
        """``[N, K]`` dequantized to the compute dtype (not a parameter: no gradient reaches the codes)."""
        return dequantize(self._parameters["weight"], self.weight_scale_inv, self.dtype_tag.dtype)

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., K]`` -> ``[..., N]`` (``x [T, g, K]`` -> ``[T, N]`` for ``groups > 1``)."""
        if self.groups > 1:
            return grouped_linear(x, self.weight, self.groups)
        return fp8_linear(x, self._parameters["weight"], self.weight_scale_inv, compute=self.compute)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Fp8Linear:
        _apply_raw(self, fn, recurse)
        return self

    def extra_repr(self) -> str:
        g = f", groups={self.groups}" if self.groups > 1 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, compute={self.compute!r}{g}"


class Fp8Experts(Experts):
    """Frozen routed experts held as FP8: ``gate_up_proj`` e4m3 ``[E, 2I, D]`` (gate rows first) with
    ``gate_up_proj_scale_inv`` fp32 ``[E, ceil(2I/128), ceil(D/128)]``, ``down_proj`` e4m3 ``[E, D, I]`` with
    ``down_proj_scale_inv`` ``[E, ceil(D/128), ceil(I/128)]`` (HF's quantized names). The forward runs
    :func:`csattn.ops.moe.moe_experts` with the scales (frozen FP8 grouped GEMMs; the input and the routing
    weights get gradients, the codes none).

    An :class:`Experts` to the model (``local``, ``num_experts``, :meth:`subset` for expert parallelism), with no
    initializer: its values come from a checkpoint. ``compute`` and ``dtype`` as for :class:`Fp8Linear`.
    """

    frozen_storage = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float,
                 backend: BackendChoice = "auto", local: range | None = None, compute: str = "fp8",
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> None:
        nn.Module.__init__(self)  # not Experts.__init__: no full-precision tensors, no initializer
        self.local = range(num_experts) if local is None else local
        self.num_experts, self.limit, self.backend = num_experts, limit, backend
        self.compute = check_compute(compute)
        self.init_seed = 0
        n, d, i = len(self.local), hidden_size, intermediate_size
        self.gate_up_proj = _frozen((n, 2 * i, d), device)
        self.down_proj = _frozen((n, d, i), device)
        b = FP8_BLOCK
        self.register_buffer("gate_up_proj_scale_inv", torch.ones(n, _cdiv(2 * i, b), _cdiv(d, b), device=device))
        self.register_buffer("down_proj_scale_inv", torch.ones(n, _cdiv(d, b), _cdiv(i, b), device=device))
        self.register_buffer("dtype_tag", torch.empty(0, dtype=dtype, device=device), persistent=False)

    @classmethod
    def like(cls, experts: Experts, compute: str, local: range | None = None) -> Fp8Experts:
        """FP8 experts of ``experts``' geometry, settings, device and dtype (zeros: load them), holding ``local``
        (default ``experts.local``)."""
        gate_up = experts.gate_up_proj
        return cls(experts.num_experts, gate_up.shape[2], gate_up.shape[1] // 2, experts.limit, experts.backend,
                   experts.local if local is None else local, compute,
                   getattr(experts, "dtype_tag", gate_up).dtype, gate_up.device)

    def reset_parameters(self) -> None:
        raise ValueError("FP8-held experts have no initializer: load them from a checkpoint (load_pretrained / "
                         "load_hf_sharded with base_precision='fp8' or 'w8a16')")

    @torch.no_grad()
    def subset(self, local: range) -> Fp8Experts:
        """These experts' ``local`` share (global ids) as new FP8 experts (an expert-parallel rank's)."""
        new = Fp8Experts.like(self, self.compute, local)
        lo, hi = local.start - self.local.start, local.stop - self.local.start
        if not self.gate_up_proj.is_meta:
            for name in self.frozen_storage:
                getattr(new, name).copy_(getattr(self, name)[lo:hi])
        return new

    def dequantized(self) -> tuple[Tensor, Tensor]:
        """``(gate_up_proj [E, 2I, D], down_proj [E, D, I])`` in the compute dtype (for references and export)."""
        dtype = self.dtype_tag.dtype
        return (dequantize(self.gate_up_proj, self.gate_up_proj_scale_inv, dtype),
                dequantize(self.down_proj, self.down_proj_scale_inv, dtype))

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the experts compute in (their inputs', and that of any adapter beside them)."""
        return self.dtype_tag.dtype

    def moe_operands(self) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """The e4m3 codes and, for :func:`csattn.ops.moe.moe_experts`, their block scales and compute mode (the
        forward is :meth:`Experts.forward`'s)."""
        return self.gate_up_proj, self.down_proj, {"gate_up_scale": self.gate_up_proj_scale_inv,
                                                   "down_scale": self.down_proj_scale_inv,
                                                   "fp8_compute": self.compute}

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Fp8Experts:
        _apply_raw(self, fn, recurse)
        return self

    def extra_repr(self) -> str:
        return f"experts={len(self.local)}/{self.num_experts}, compute={self.compute!r}"


def hold_in_fp8(model: nn.Module, compute: str, linears: Iterable[str] = ()) -> nn.Module:
    """Give ``model`` FP8-held frozen weights in place: every routed :class:`Experts` becomes :class:`Fp8Experts`
    and each module named in ``linears`` (qualified names, e.g. ``"model.layers.0.self_attn.q_b_proj"``; an
    ``nn.Linear`` without bias or a ``GroupedLinear``) an :class:`Fp8Linear`, on the same device (the meta device
    too) and compute dtype. The new tensors are zeros (scale 1): load their values (``load_pretrained``,
    ``csattn.parallel.load_hf_sharded``). Call it before sharding the model; it returns ``model``."""
    check_compute(compute)
    wanted = set(linears)
    modules = dict(model.named_modules())
    missing = sorted(wanted - set(modules))
    if missing:
        raise ValueError(f"linears= names {missing[:4]}, which are not modules of the model")
    for name, module in list(modules.items()):
        if isinstance(module, Experts) and not isinstance(module, Fp8Experts):
            model.set_submodule(name, Fp8Experts.like(module, compute))
        elif name in wanted:
            model.set_submodule(name, _fp8_linear_like(name, module, compute))
    return model


def _fp8_linear_like(name: str, module: nn.Module, compute: str) -> Fp8Linear:
    w = module._parameters.get("weight")
    if w is None or w.dim() != 2 or getattr(module, "bias", None) is not None:
        raise ValueError(f"module {name!r} ({type(module).__name__}) is not a linear without bias: it cannot be held "
                         "in FP8")
    return Fp8Linear(w.shape[1], w.shape[0], compute, w.dtype, getattr(module, "groups", 1), w.device)


