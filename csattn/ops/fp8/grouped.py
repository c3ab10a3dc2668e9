"""``fp8_grouped_mm``: the MoE expert GEMMs over expert-sorted rows with frozen FP8 weights (see ``README.md``)."""

from __future__ import annotations

import functools
import re

import torch
from torch import Tensor

from ..backend import interpreting
from .naive import _check_grouped, fp8_grouped_mm_ref

__all__ = ["COMPUTES", "check_compute", "fp8_grouped_mm", "gluon_fits", "kernel_compute"]

COMPUTES = ("fp8", "w8a16")
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def check_compute(compute: str) -> str:
    """``compute`` itself if it is one of :data:`COMPUTES`, else a ``ValueError`` naming them."""
    if compute not in COMPUTES:
        raise ValueError(f"compute must be 'fp8' (FP8 tensor cores) or 'w8a16' (bf16 numerics on FP8 storage), "
                         f"got {compute!r}")
    return compute


def kernel_compute(x: Tensor, compute: str) -> str | None:
    """The kernel mode the FP8 ops run for activations ``x`` and ``compute``: ``"fp8"`` (FP8 tensor cores, sm_89+),
    ``"w8a16"`` (bf16 / fp16 tensor cores), or None for the reference (CPU, fp32 / fp64, older GPUs)."""
    check_compute(compute)
    if x.device.type != "cuda" or x.dtype not in KERNEL_DTYPES:
        return None
    cap = torch.cuda.get_device_capability(x.device)
    if compute == "fp8":
        return "fp8" if cap >= (8, 9) else None
    return "w8a16" if cap >= (8, 0) else None


def fp8_grouped_mm(a: Tensor, weight: Tensor, scale: Tensor, offs: Tensor, trans: bool = False,
                   compute: str = "fp8") -> Tensor:
    """Expert GEMMs over contiguous expert-sorted rows, frozen FP8 weights.

    Args:
        a: ``[M, K]`` (``trans=False``) or ``[M, N]`` (``trans=True``), rows sorted by expert.
        weight: ``[E, N, K]`` ``float8_e4m3fn`` (not requiring grad). scale: ``[E, ceil(N/128), ceil(K/128)]`` fp32.
        offs: ``[E]`` int32, cumulative row end of each expert (as ``torch.nn.functional.grouped_mm`` takes);
            ``offs[-1] <= M``.
        trans: False: rows of expert ``e`` times ``W_e^T`` -> ``[M, N]`` (gate/up and down forward); True: times
            ``W_e`` -> ``[M, K]`` (their input gradients).
        compute: ``"fp8"``: ``a`` quantized per 1x128 tile (fused kernel), FP8 MMA, fp32 accumulation with the
            scales applied per 128-deep block (on sm_90 with ``N``, ``K`` multiples of 128 the Gluon kernel, both
            directions; elsewhere ``trans=True`` runs W8A16, as measured faster there); ``"w8a16"``: the
            weight tile cast to ``a``'s dtype in the kernel, bf16 / fp16 MMA.
            On CPU, for fp32 / fp64 ``a`` or GPUs without the MMA, the reference runs (``W_e`` dequantized to
            ``a``'s dtype one expert at a time, plain matmuls).

    Returns:
        ``[M, N]`` or ``[M, K]`` in ``a``'s dtype; rows past ``offs[-1]`` are zero. Not differentiable (callers
        use it inside their own backward): ``a`` that requires grad under grad mode is refused.
    """
    _check_grouped(a, weight, scale, offs, trans)
    if a.requires_grad and torch.is_grad_enabled():
        raise ValueError("fp8_grouped_mm is not differentiable: call it under torch.no_grad() or inside an "
                         "autograd.Function (the MoE op does), or use fp8_linear for a differentiable dense layer")
    mode = kernel_compute(a, compute)
    if mode is None:
        return fp8_grouped_mm_ref(a, weight, scale, offs, trans)
    from .triton import grouped_mm_triton, quantize_1x128_triton  # lazy: Triton optional

    if mode == "fp8" and gluon_fits(a, weight):
        from .gluon import grouped_mm_gluon  # lazy: Gluon is experimental API

        q, s = quantize_1x128_triton(a)
        return grouped_mm_gluon(q, s, weight, scale, offs, trans, out_dtype=a.dtype)
    if mode == "fp8" and not trans:
        q, s = quantize_1x128_triton(a)
        return grouped_mm_triton(q, s, weight, scale, offs, False, out_dtype=a.dtype)
    # trans=True elsewhere runs W8A16 in both modes: FP8 MMA wants W K-major, and neither Triton's transposition of
    # the FP8 tile (91-125 TFLOP/s on the H200) nor a transposed copy per call (107-110) beat the bf16 MMA on the
    # cast tile (~235); the Gluon kernel transposes the tile in shared memory (see README.md)
    return grouped_mm_triton(a, None, weight, scale, offs, trans, out_dtype=a.dtype)


@functools.cache
def _gluon_available() -> bool:
    """Whether this Triton builds the Gluon kernel: measured on 3.6, compiled on 3.9 (a CPU test builds it for
    sm_90); Gluon is experimental API that changes between releases."""
    import triton

    if tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2]) < (3, 6):
        return False
    try:
        from .gluon import fp8_grouped_gluon_kernel  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return True


def gluon_fits(a: Tensor, weight: Tensor) -> bool:
    """Whether the FP8 grouped GEMM runs the Gluon kernel (``gluon.py``) for activations ``a`` and the weight
    ``[E, N, K]``: sm_90 (Hopper's warpgroup MMA and TMA), not under the interpreter, ``N`` and ``K`` multiples
    of 128 (each 128-wide output tile and contraction step one block of scales). Elsewhere the Triton kernel runs."""
    if a.device.type != "cuda" or interpreting() or weight.shape[-1] % 128 or weight.shape[-2] % 128:
        return False
    return torch.cuda.get_device_capability(a.device) == (9, 0) and _gluon_available()
