"""``quantize_1x128`` and ``fp8_linear``: a dense linear with a frozen FP8 weight, differentiable in its input
(see ``README.md``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...amp import autocast_dtype, autocast_off
from .grouped import Fp8Rows, kernel_compute, transposed_weight
from .naive import BLOCK, check_weight, dequantize, fp8_linear_ref, quantize_1x128_ref

__all__ = ["DGRAD", "DGRADS", "fp8_linear", "input_grad", "quantize_1x128", "quantize_1x128_rows"]

# how the input gradient dY @ W runs, by compute mode (measured on the H200: lab/fp8_ops.md)
DGRADS = ("copy", "bf16", "triton")
DGRAD = {"fp8": "copy", "w8a16": "bf16"}


def quantize_1x128(x: Tensor, scale_t: bool = False) -> tuple[Tensor, Tensor]:
    """``x [M, K]`` (bf16 / fp16 / fp32) -> ``q [M, K]`` e4m3 and ``s [M, ceil(K/128)]`` fp32, ``x ~ q * s`` per 1x128
    tile: ``s = amax / 448``, 1 for an all-zero tile; ``q = clamp(x / s, -448, 448)`` rounded to nearest even.

    On CUDA one fused Triton kernel (one read of ``x``); elsewhere the reference. ``scale_t``: ``s`` is the
    ``[M, ceil(K/128)]`` view of a ``[ceil(K/128), M]`` tensor (the layout ``torch._scaled_mm`` takes).
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_1x128 takes x [M, K], got {tuple(x.shape)}")
    if x.device.type == "cuda":
        from .triton import quantize_1x128_triton

        return quantize_1x128_triton(x, scale_t)
    q, s = quantize_1x128_ref(x)
    return (q, s.t().contiguous().t()) if scale_t else (q, s)


def quantize_1x128_rows(x: Tensor, dest: Tensor) -> Fp8Rows:
    """``x [T, K]`` quantized per 1x128 tile (:func:`quantize_1x128`'s bits) into rows ``dest [T, c]`` of ``[T c,
    K]``: row ``dest[t, j]`` holds ``x[t]``'s codes and scales; ``dest`` int64, a permutation of ``[0, T c)`` (the
    MoE's ``inv``: each token's rows in expert order). The same rows as ``Fp8Rows(*quantize_1x128(x))`` gathered
    by the inverse permutation, in one pass on CUDA (``x`` read once, no quantized copy at token level written and
    read again); elsewhere the reference's quantization and a copy into the rows."""
    if x.dim() != 2 or dest.dim() != 2 or dest.shape[0] != x.shape[0] or dest.dtype != torch.int64:
        raise ValueError(f"quantize_1x128_rows takes x [T, K] and dest [T, c] int64, got x {tuple(x.shape)}, dest "
                         f"{dest.dtype} {tuple(dest.shape)}")
    if x.device.type == "cuda":
        from .triton import quantize_rows_triton

        return Fp8Rows(*quantize_rows_triton(x, dest))
    token = torch.empty_like(dest.reshape(-1))  # the inverse permutation: the token row of each destination
    token[dest.reshape(-1)] = torch.arange(x.shape[0], device=x.device).repeat_interleave(dest.shape[1])
    return Fp8Rows(*quantize_1x128_ref(x)).index_select(token)


# cuBLAS's blockwise FP8 GEMM (torch 2.11 / CUDA 13 on the H200) returns wrong values, even NaN, for a contraction
# of fewer than 4 blocks when the output has more than one column block (lab/probes/scaled_mm_shapes.py: relative
# errors 0.3 to 1e34 at K 128-384, N 256-2048; right at K 512 and beyond): such shapes run the Triton kernel
SCALED_MM_MIN_K = 4 * BLOCK


def _scaled_mm_ok(a: Tensor, n_out: int) -> bool:
    """Whether cuBLAS's blockwise FP8 GEMM (sm_90 ``torch._scaled_mm`` with 1x128 / 128x128 scales) takes ``a
    [M, C] @ B [C, n_out]`` and computes it right: Hopper, all dimensions whole blocks / aligned, ``C`` at least
    :data:`SCALED_MM_MIN_K`."""
    return (torch.cuda.get_device_capability(a.device) == (9, 0) and a.shape[0] % 16 == 0
            and a.shape[1] % BLOCK == 0 and a.shape[1] >= SCALED_MM_MIN_K and n_out % BLOCK == 0)


def _one_group(a: Tensor) -> Tensor:
    return torch.full((1,), a.shape[0], dtype=torch.int32, device=a.device)


def _matmul(a: Tensor, weight: Tensor, scale: Tensor, mode: str, trans: bool) -> Tensor:
    """``a [M, C] @ W^T`` (``trans=False``, ``C = K``) or ``@ W`` (``trans=True``, ``C = N``) on the kernels,
    ``mode`` "fp8" or "w8a16"; for ``trans=True`` in "fp8" by the Triton kernel (see :func:`input_grad`)."""
    from .triton import grouped_mm_triton, quantize_1x128_triton

    n_out = weight.shape[-1] if trans else weight.shape[-2]
    if mode == "w8a16":
        return grouped_mm_triton(a, None, weight[None], scale[None], _one_group(a), trans, out_dtype=a.dtype)
    if not trans and _scaled_mm_ok(a, n_out):
        q, s = quantize_1x128_triton(a, scale_t=True)
        return torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scale.t(), out_dtype=a.dtype)
    q, s = quantize_1x128_triton(a)
    return grouped_mm_triton(q, s, weight[None], scale[None], _one_group(a), trans, out_dtype=a.dtype)


def input_grad(dy: Tensor, weight: Tensor, scale: Tensor, mode: str, method: str) -> Tensor:
    """``dy [M, N] @ dequant(W [N, K])`` -> ``[M, K]`` by ``method``:

    - ``"copy"``: a K-major FP8 copy of ``W`` (and its scales) made for this call and freed
      (:func:`~.grouped.transposed_weight`), then the same cuBLAS / Triton GEMM as the forward (cuBLAS's FP8 GEMM
      takes K-major operands only);
    - ``"bf16"``: ``W`` dequantized to ``dy``'s dtype for this call, a plain matmul;
    - ``"triton"``: the grouped kernel with one group and the weight walked transposed (``mode`` "fp8": FP8 MMA
      on the quantized ``dy``; "w8a16": the weight tile cast in the kernel).
    """
    if method == "bf16":
        return dy @ dequantize(weight, scale, dy.dtype)
    if method == "copy":
        return _matmul(dy, *transposed_weight(weight, scale), mode, trans=False)
    if method == "triton":
        return _matmul(dy, weight, scale, mode, trans=True)
    raise ValueError(f"method must be one of {DGRADS}, got {method!r}")


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, scale: Tensor, mode: str) -> Tensor:
        ctx.mode = mode
        ctx.save_for_backward(weight, scale)
        x2 = x.reshape(-1, x.shape[-1])
        return _matmul(x2, weight, scale, mode, trans=False).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: Tensor):
        weight, scale = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = input_grad(dy2, weight, scale, ctx.mode, DGRAD[ctx.mode])
        return dx.view(*dy.shape[:-1], weight.shape[1]), None, None, None


def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, compute: str = "fp8") -> Tensor:
    """``x [..., K] @ dequant(weight [N, K]).T`` -> ``[..., N]`` with a frozen FP8 weight; differentiable in ``x``
    only (a weight that requires grad is refused).

    ``compute="fp8"``: ``x`` quantized per 1x128 tile (fused kernel), FP8 tensor cores, fp32 accumulation (sm_90:
    cuBLAS blockwise ``torch._scaled_mm``; other sm_89+ / unaligned shapes: the Triton kernel); the input gradient
    likewise FP8 (:data:`DGRAD`). ``compute="w8a16"``: the weight tile dequantized to ``x``'s dtype inside the
    kernel, bf16 / fp16 MMA. CPU, fp32 / fp64 ``x`` and older GPUs: the reference (the weight dequantized to
    ``x``'s dtype, a plain matmul). Under ``torch.autocast`` ``x`` is cast to the autocast dtype first and the result
    is in it, as for a linear (see :mod:`csattn.amp`).
    """
    low = autocast_dtype(x)
    if low is not None:
        with autocast_off(x):
            return fp8_linear(x.to(low), weight, scale, compute)
    check_weight(weight, scale)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear takes x [..., K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    mode = kernel_compute(x, compute)
    if mode is None:
        return fp8_linear_ref(x, weight, scale)
    return _FP8Linear.apply(x, weight, scale, mode)
