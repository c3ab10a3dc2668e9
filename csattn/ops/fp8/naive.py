"""Plain-PyTorch references of the FP8 ops: block dequantization, the 1x128 activation quantizer, the frozen FP8
linear and the MoE grouped GEMM over expert-sorted rows, and the same computations on the quantized operands
(what the FP8 kernels compute, up to fp32 summation order), which the kernel tests compare against.

Formats (DeepSeek's release): a weight ``q [..., N, K]`` in ``torch.float8_e4m3fn`` with fp32 block scales
``s [..., ceil(N/128), ceil(K/128)]``, ``w[n, k] = q[n, k] * s[n // 128, k // 128]``; an activation ``x [M, K]``
quantized per 1x128 tile, ``x[m, k] ~ q[m, k] * s[m, k // 128]``, ``s = amax / 448`` (an all-zero tile takes
scale 1).

The grouped references loop over experts and read the group ends on the host: references, not fast paths. They
dequantize one expert at a time, never all experts at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BLOCK", "FP8_DTYPE", "FP8_MAX", "check_weight", "dequantize", "fp8_grouped_mm_quantized",
           "fp8_grouped_mm_ref", "fp8_linear_quantized", "fp8_linear_ref", "quantize_1x128_ref"]

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_weight(weight: Tensor, scale: Tensor, name: str = "weight") -> None:
    """Raise a ``ValueError`` unless ``weight`` is a frozen e4m3 tensor ``[..., N, K]`` with fp32 block scales
    ``[..., ceil(N/128), ceil(K/128)]`` on its device."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"{name} must be torch.float8_e4m3fn (DeepSeek's FP8 release format), got {weight.dtype}")
    if weight.requires_grad:
        raise ValueError(f"{name} requires grad, but the FP8 ops hold the base frozen and give it no gradient: "
                         "call requires_grad_(False) on it (train adapters beside it instead)")
    want = (*weight.shape[:-2], _cdiv(weight.shape[-2], BLOCK), _cdiv(weight.shape[-1], BLOCK))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want:
        raise ValueError(f"scale of {name} {tuple(weight.shape)} must be fp32 {want} (one per 128x128 block), got "
                         f"{scale.dtype} {tuple(scale.shape)}")
    if scale.device != weight.device:
        raise ValueError(f"scale of {name} is on {scale.device}, the weight on {weight.device}: put them together")


def _expand(scale: Tensor, rows: int, cols: int) -> Tensor:
    """``[..., R, C]`` block scales -> ``[..., rows, cols]`` (each scale repeated over its 128x128 block)."""
    s = scale.repeat_interleave(BLOCK, dim=-2)[..., :rows, :]
    return s.repeat_interleave(BLOCK, dim=-1)[..., :cols]


def dequantize(weight: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``weight [..., N, K]`` e4m3 times its ``[..., ceil(N/128), ceil(K/128)]`` block scales, in ``dtype``
    (the product in fp32, or fp64 for fp64, rounded once)."""
    c = torch.promote_types(dtype, torch.float32)
    w = weight.to(c) * _expand(scale.to(c), weight.shape[-2], weight.shape[-1])
    return w.to(dtype)


def quantize_1x128_ref(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x [M, K]`` -> ``q [M, K]`` e4m3, ``s [M, ceil(K/128)]`` fp32 with ``x ~ q * s`` per 1x128 tile.

    ``s = amax(|tile|) / 448`` in fp32; an all-zero tile takes ``s = 1`` (its ``q`` is zero either way);
    ``q = clamp(x / s, -448, 448)`` rounded to nearest even. Non-finite inputs propagate (NaN scale).
    """
    m, k = x.shape
    kb = _cdiv(k, BLOCK)
    xf = torch.nn.functional.pad(x.float(), (0, kb * BLOCK - k)).view(m, kb, BLOCK)
    amax = xf.abs().amax(-1)
    # a true division by a tensor: torch's CUDA division by a Python scalar multiplies by its reciprocal instead,
    # which differs in the last bit (the kernel divides in IEEE too)
    s = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, FP8_MAX))
    q = (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, kb * BLOCK)[:, :k].contiguous(), s


def fp8_linear_ref(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """``x [..., K] @ dequant(weight [N, K]).T`` -> ``[..., N]``: the weight dequantized to ``x``'s dtype, a plain
    matmul in it (differentiable in ``x``)."""
    return torch.nn.functional.linear(x, dequantize(weight, scale, x.dtype))


def fp8_linear_quantized(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """What the FP8 linear computes: ``x [M, K]`` quantized 1x128, times the dequantized weight, in fp64 (the
    kernel differs by its fp32 summation only)."""
    return _dequant_rows(*quantize_1x128_ref(x)) @ dequantize(weight, scale, torch.float64).T


def _dequant_rows(q: Tensor, s: Tensor) -> Tensor:
    """``q [M, K] * s [M, ceil(K/128)]`` per 1x128 tile, in fp64."""
    return q.double() * s.double().repeat_interleave(BLOCK, dim=-1)[:, :q.shape[-1]]


def _groups(offs: Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()  # host read: reference only
    return [(lo, hi) for lo, hi in zip([0] + ends[:-1], ends)]


def _check_grouped(a: Tensor, weight: Tensor, scale: Tensor, offs: Tensor, trans: bool) -> None:
    check_weight(weight, scale)
    if a.dim() != 2 or weight.dim() != 3:
        raise ValueError(f"fp8_grouped_mm takes a [M, K] and weight [E, N, K], got {tuple(a.shape)} and "
                         f"{tuple(weight.shape)}")
    contract = weight.shape[-2] if trans else weight.shape[-1]
    if a.shape[-1] != contract:
        raise ValueError(f"a {tuple(a.shape)} must have {contract} columns for weight {tuple(weight.shape)} with "
                         f"trans={trans}")
    if offs.dim() != 1 or offs.shape[0] != weight.shape[0] or offs.dtype != torch.int32:
        raise ValueError(f"offs must be int32 [E] = [{weight.shape[0]}] (cumulative row ends), got {offs.dtype} "
                         f"{tuple(offs.shape)}")


def _per_expert(a: Tensor, weight: Tensor, scale: Tensor, offs: Tensor, trans: bool) -> Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``a`` times ``W_e^T`` (``W_e`` for ``trans``), each ``W_e`` dequantized to
    ``a``'s dtype when its rows come up; rows past ``offs[-1]`` zero."""
    out = a.new_zeros((a.shape[0], weight.shape[-1] if trans else weight.shape[-2]))
    for e, (lo, hi) in enumerate(_groups(offs)):
        if hi > lo:
            w = dequantize(weight[e], scale[e], a.dtype)
            out[lo:hi] = a[lo:hi] @ (w if trans else w.T)
    return out


def fp8_grouped_mm_ref(a: Tensor, weight: Tensor, scale: Tensor, offs: Tensor, trans: bool = False) -> Tensor:
    """Grouped GEMM over expert-sorted rows by a loop of plain matmuls in ``a``'s dtype.

    ``trans=False``: ``a [M, K]``, ``weight [E, N, K]`` -> ``[M, N]``, rows ``offs[e-1]:offs[e]`` times
    ``W_e^T``; ``trans=True``: ``a [M, N]`` -> ``[M, K]``, rows times ``W_e``. Rows past ``offs[-1]`` are zero.
    Each ``W_e`` is dequantized to ``a``'s dtype when its rows come up.
    """
    _check_grouped(a, weight, scale, offs, trans)
    return _per_expert(a, weight, scale, offs, trans)


def fp8_grouped_mm_quantized(a: Tensor, weight: Tensor, scale: Tensor, offs: Tensor, trans: bool = False,
                             quantize_a: bool = True) -> Tensor:
    """What the grouped kernel computes, in fp64: ``a`` quantized 1x128 along its columns (``quantize_a``; else
    taken as it is, the W8A16 mode), times each dequantized ``W_e``. Rows past ``offs[-1]`` are zero."""
    _check_grouped(a, weight, scale, offs, trans)
    ad = _dequant_rows(*quantize_1x128_ref(a)) if quantize_a else a.double()
    return _per_expert(ad, weight, scale, offs, trans)


def low_rank_ref(v: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``v [M, R]``, ``w [E, N, R]`` -> ``[M, N]``: rows of group ``e`` times ``w[e]^T`` (the low-rank term of
    :func:`~csattn.ops.fp8.fp8_grouped_mm`), rows past ``offs[-1]`` zero; a loop of plain matmuls in ``v``'s
    dtype."""
    out = v.new_zeros((v.shape[0], w.shape[1]))
    for e, (lo, hi) in enumerate(_groups(offs)):
        if hi > lo:
            out[lo:hi] = v[lo:hi] @ w[e].T
    return out
