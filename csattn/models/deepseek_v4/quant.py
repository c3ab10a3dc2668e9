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

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["E2M1_VALUES", "FP8_BLOCK", "MXFP4_GROUP", "QuantConfig", "decode_scale", "dequantize_fp8",
           "dequantize_mxfp4", "is_fp4_packed", "is_fp8", "mxfp4_to_fp8"]

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


def decode_scale(scale: Tensor, name: str = "scale") -> Tensor:
    """Scale values as fp32 (same shape): ue8m0 (``float8_e8m0fnu`` or ``uint8`` bytes) -> ``2 ** (byte - 127)``,
    floats as they are. ``ValueError`` naming ``name`` for other dtypes or ue8m0 NaN (byte 255)."""
    if scale.dtype == torch.uint8 or (_E8M0 is not None and scale.dtype == _E8M0):
        byte = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
        if bool((byte == 255).any()):
            raise ValueError(f"tensor {name!r}: ue8m0 scale byte 255 (NaN); the checkpoint is corrupt")
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
    out = torch.empty(weight.shape, dtype=dtype)
    step = _row_chunk(n, k, bn)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        # expand this chunk's scales to [.., r1-r0, K]: rows then columns, cut to the ragged edges
        sc = s[..., r0 // bn: -(-r1 // bn), :].repeat_interleave(bn, dim=-2)[..., : r1 - r0, :]
        sc = sc.repeat_interleave(bk, dim=-1)[..., :k]
        out[..., r0:r1, :] = (weight[..., r0:r1, :].to(torch.float32) * sc).to(dtype)
    return out


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
    s = decode_scale(scale, name)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    u8 = packed.contiguous().view(torch.uint8)
    out = torch.empty((*packed.shape[:-1], k), dtype=dtype)
    step = _row_chunk(n, k, 1)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        b = u8[..., r0:r1, :]
        vals = torch.stack([lut[(b & 0xF).long()], lut[(b >> 4).long()]], dim=-1).flatten(-2)  # low nibble first
        sc = s[..., r0:r1, :].repeat_interleave(MXFP4_GROUP, dim=-1)[..., :k]
        out[..., r0:r1, :] = (vals * sc).to(dtype)
    return out


# ------------------------------------------------------------------------------------- MXFP4 -> FP8, exactly
FP8_BLOCK = 128  # rows and columns per scale of the FP8-held weights (the release's weight_block_size)
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
    if scale.dtype == torch.uint8 or (_E8M0 is not None and scale.dtype == _E8M0):
        byte = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
        if bool((byte == 255).any()):
            raise ValueError(f"tensor {name!r}: ue8m0 scale byte 255 (NaN); the checkpoint is corrupt")
        return byte.to(torch.int32) - 127
    s = decode_scale(scale, name)
    mant, exp = torch.frexp(s)
    if not bool((mant == 0.5).all()):
        raise ValueError(f"tensor {name!r}: MXFP4 group scales must be powers of two (ue8m0); this one holds "
                         "others, which FP8 with power-of-two block scales cannot reproduce")
    return exp - 1


def _blocks(t: Tensor, fill: int) -> Tensor:
    """``[..., N, K]`` -> ``[..., ceil(N/128), ceil(K/128), 128 * 128]`` (padded with ``fill``)."""
    b = FP8_BLOCK
    n, k = t.shape[-2:]
    r, c = -(-n // b), -(-k // b)
    pad = t.new_full((*t.shape[:-2], r * b, c * b), fill)
    pad[..., :n, :k] = t
    return pad.view(*t.shape[:-2], r, b, c, b).transpose(-3, -2).reshape(*t.shape[:-2], r, c, b * b)


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

    Raises:
        ValueError: naming ``name`` for a wrong dtype or shape, ue8m0 byte 255 (NaN), non-power-of-two scales.
    """
    if not is_fp4_packed(packed) or packed.dim() < 2:
        raise ValueError(f"tensor {name!r} ({packed.dtype}, {tuple(packed.shape)}) is not a packed MXFP4 weight "
                         "[..., N, K / 2] of int8 / uint8 / float4_e2m1fn_x2")
    n, half = packed.shape[-2:]
    k = 2 * half
    want = (*packed.shape[:-1], -(-k // MXFP4_GROUP))
    if tuple(scale.shape) != want:
        raise ValueError(f"tensor {name!r}: scale has shape {tuple(scale.shape)} but packed MXFP4 weight "
                         f"{tuple(packed.shape)} (K = {k}) needs {want} (one per {MXFP4_GROUP} values along K)")
    exp = _group_exponents(scale, name).repeat_interleave(MXFP4_GROUP, dim=-1)[..., :k]  # [..., N, K]
    u8 = packed.contiguous().view(torch.uint8)
    code = torch.stack([u8 & 0xF, u8 >> 4], dim=-1).flatten(-2).to(torch.int32)  # low nibble = even column
    mag = code & 7
    q = torch.tensor(_E2M1_Q0)[mag] + exp
    nonzero = mag > 0
    # every value's admissible block exponents [q - top, q + 9]; zeros admit any
    lo = _blocks(torch.where(nonzero, q - torch.tensor(_E2M1_TOP)[mag], -_NONE), -_NONE).amax(dim=-1)
    hi = _blocks(torch.where(nonzero, q - _E4M3_LOW, _NONE), _NONE).amin(dim=-1)
    empty = lo == -_NONE
    p = torch.where(empty, 0, lo)
    inexact = ~empty & (lo > hi)
    # each value's exponent under its block's scale; below -40 it rounds to 0 either way, and fp32 stays exact
    p_full = p.repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :].repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]
    shift = (exp - p_full).clamp_(-40, 40).to(torch.float32)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    weight = (lut[code] * torch.exp2(shift)).to(torch.float8_e4m3fn)
    # 2**p as fp32: exact from fp64 (p >= -136 > fp32's smallest subnormal exponent -149)
    block_scale = torch.exp2(p.to(torch.float64)).to(torch.float32)
    return weight, block_scale, inexact
