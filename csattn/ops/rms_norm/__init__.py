"""RMSNorm with weight whose backward keeps only the input (in its own dtype) and one fp32 scale per row.

Why: written as plain autograd (``x.float() * rsqrt(mean(x^2) + eps) * w``), the norm saves an fp32 copy of
its input and the fp32 normalized rows for the backward: 8 bytes per channel, four times a bf16 input. At
32k tokens that is 256 MiB for the query latent (1024 channels) and 128 MiB for the raw K = V rows (512)
of every layer. Here the backward recomputes the normalized rows from the saved input and ``1 / rms``.

Both directions run over row chunks of at most ``CHUNK_BYTES`` of fp32 per temporary: the fp32 temporaries of
the whole input (four or five of them in the backward, 2.5 GiB at 128k tokens and 1024 channels) were the peak
of a CSA layer's backward. Every row is computed exactly as the plain form computes it (fp32 math, the weight
applied before the cast back); only the weight gradient's sum over rows is taken chunk by chunk. On CUDA the
same math runs as two Triton kernels (:mod:`.triton`), one pass over the rows each way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..autograd import named_grads
from ..backend import BackendChoice, resolve_backend
from .naive import rms_norm_ref

__all__ = ["rms_norm", "rms_norm_backward", "rms_norm_forward", "rms_norm_ref"]

CHUNK_BYTES = 64 << 20  # fp32 bytes per temporary per chunk


def _chunk_rows(channels: int) -> int:
    return max(1, CHUNK_BYTES // (4 * channels))


def _use_triton(x: Tensor, backend: BackendChoice) -> bool:
    """``"auto"``: the Triton kernels on CUDA for rows they take in registers, the PyTorch chunks elsewhere."""
    if resolve_backend(backend, x) != "triton":
        return False
    if backend == "auto":
        from .triton import MAX_CHANNELS  # lazy: importing csattn (and its CPU path) must not need Triton

        return x.shape[-1] <= MAX_CHANNELS
    return True


def rms_norm_forward(x: Tensor, weight: Tensor, eps: float, backend: BackendChoice = "auto") -> tuple[Tensor, Tensor]:
    """``(out, rstd)``: the normed rows ``[..., C]`` in ``x.dtype`` and ``1 / rms`` per row ``[R, 1]`` (fp32, fp64
    for fp64 input), without autograd; the forward of :func:`rms_norm`, shared with fused callers that keep
    ``x`` some other way (e.g. the mHC site recomputes its collapse). ``backend``: ``"auto"`` (Triton on CUDA),
    ``"reference"`` (the PyTorch row chunks) or ``"triton"`` (also the CPU interpreter)."""
    if _use_triton(x, backend):
        from .triton import rms_norm_fwd_triton

        return rms_norm_fwd_triton(x, weight, eps)
    compute = torch.promote_types(x.dtype, torch.float32)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    rstd = torch.empty((rows.shape[0], 1), dtype=compute, device=x.device)
    w = weight.to(compute)
    step = _chunk_rows(x.shape[-1])
    for lo in range(0, rows.shape[0], step):
        h = rows[lo:lo + step].to(compute)
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        rstd[lo:lo + step] = r
        out[lo:lo + step] = (w * (h * r)).to(x.dtype)
    return out.view(x.shape), rstd


def rms_norm_backward(x: Tensor, weight: Tensor, rstd: Tensor, dy: Tensor, need_x: bool = True,
                      need_w: bool = True, backend: BackendChoice = "auto") -> tuple[Tensor | None, Tensor | None]:
    """``(dx, dweight)`` of :func:`rms_norm` from its input ``x [..., C]``, ``weight [C]``, the forward's ``rstd
    [R, 1]`` and ``dy [..., C]`` (None where not needed); ``backend`` as in :func:`rms_norm_forward`."""
    if _use_triton(x, backend):
        from .triton import rms_norm_bwd_triton

        return rms_norm_bwd_triton(x, weight, rstd, dy, need_x, need_w)
    compute = rstd.dtype
    rows, g_rows = x.reshape(-1, x.shape[-1]), dy.reshape(-1, x.shape[-1])
    dx = torch.empty_like(rows) if need_x else None
    dw = torch.zeros(weight.shape, dtype=compute, device=weight.device) if need_w else None
    w = weight.to(compute)
    step = _chunk_rows(x.shape[-1])
    for lo in range(0, rows.shape[0], step):
        h = rows[lo:lo + step].to(compute)
        r = rstd[lo:lo + step]
        g = g_rows[lo:lo + step].to(compute)
        if need_w:
            dw += (g * (h * r)).sum(0)
        if need_x:
            gw = g * w
            # d/dx of w * x * rstd(x) = gw * rstd - x * rstd^3 * mean(gw * x), in the order plain autograd
            # takes: the sum nearly cancels against the first term along x, and an upstream gradient that
            # sums over the normalized rows (a scale-invariant consumer) sees that residue
            dx[lo:lo + step] = (gw * r + h * ((gw * h).sum(-1, keepdim=True) * (-r.pow(3) / x.shape[-1])))
    return (None if dx is None else dx.view(x.shape), None if dw is None else dw.to(weight.dtype))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, backend: BackendChoice) -> Tensor:
        out, rstd = rms_norm_forward(x, weight, eps, backend)
        ctx.save_for_backward(x, weight, rstd)
        ctx.backend = backend
        return out

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(x, weight, rstd, dy, *ctx.needs_input_grad[:2], backend=ctx.backend)
        return _RMSNormGrads(x=dx, weight=dw)


_RMSNormGrads = named_grads(_RMSNorm)


def rms_norm(x: Tensor, weight: Tensor, eps: float, backend: BackendChoice = "auto") -> Tensor:
    """``w * x / sqrt(mean(x^2) + eps)`` over the last dimension, in fp32 (fp64 for fp64 input), cast back.

    Args:
        x: ``[..., C]``. weight: ``[C]``. eps: added to the mean square.

        backend: ``"auto"`` (the Triton kernels on CUDA), ``"reference"`` (PyTorch row chunks) or ``"triton"``.

    Returns:
        ``[..., C]`` in ``x.dtype``. Saves ``x`` and one fp32 scale per row for the backward.
    """
    return _RMSNorm.apply(x, weight, eps, backend)
