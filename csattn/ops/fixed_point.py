"""Exact fixed-point accumulation: what makes the scatter-add gradients of the fused kernels deterministic.

Several query rows add into the same key row (sparse attention's ``dkv``, the indexer loss's ``dk``), and fp32
atomics sum in whatever order the GPU schedules them: not bitwise reproducible. With ``deterministic=True`` in
the kernel configs (set by their caller: csattn/deterministic.py), each contribution ``x`` is rounded once to an
integer ``round(x * 2**e)`` and added with int64 atomics into an int64 buffer. Integer addition is
associative, so the sum is the same bits whatever the order (also across GPUs with other SM counts and grids); the
host turns it back into floats once (``sum * 2**-e``). Workspace: an int64 ``[N, d]`` buffer (``N * d * 8``
bytes) instead of the fp32 one.

The exponent ``e`` comes from a bound ``B`` on the magnitude of every partial sum, computed on the device from
maxima of the inputs (one read of each, no host sync): ``e = floor(60 - log2 B)``, so ``|sum| * 2**e <= 2**60``
and nothing overflows. Each term is rounded once, by at most ``2**-(e + 1)``, so an entry summing ``n`` terms is off
by at most ``n * B * 2**-60`` (``B`` as rounded in ``e``), plus one fp32 rounding at the end. The bounds are loose
(sparse attention's is ``rows * heads`` times a per-(row, head) maximum, some ``2**26`` at 32k tokens), yet with
``n <= rows = 2**15`` that is ``2**-19`` of the per-(row, head) maximum: about fp32 atomics' own worst case over that
many terms and far below bf16's rounding of the gradient. A non-finite bound (an inf or NaN among the inputs) makes
the whole result NaN, as fp32 atomics would spread it.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["abs_max", "fixed_point_scale", "from_fixed_point"]

_HEADROOM_BITS = 60  # |partial sum| * 2**e <= 2**60: int64 has 3 more bits for the bound's rounding in log2


def abs_max(x: Tensor) -> Tensor:
    """``max |x|`` as a 0-d fp32 tensor on ``x``'s device (one pass, no temporary; 0 for an empty ``x``)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(-lo, hi).float()


def fixed_point_scale(bound: Tensor) -> Tensor:
    """``[3]`` fp32 ``(2**e, 2**-e, 0 or NaN)`` for a bound ``B >= |every partial sum|`` (0-d tensor): ``e = floor(60 -
    log2 B)`` clamped to ``[-120, 120]`` (B = 0 gives ``2**120``: every contribution is 0 then). The kernels read
    ``2**e`` from the device; :func:`from_fixed_point` takes the rest (the NaN where ``B`` is not finite)."""
    b = bound.float().reshape(())
    e = torch.floor(_HEADROOM_BITS - torch.log2(b)).clamp(-120.0, 120.0)
    e = torch.where(torch.isfinite(b), e, torch.zeros_like(e))
    return torch.stack([torch.exp2(e), torch.exp2(-e), torch.where(torch.isfinite(b), 0.0, float("nan"))])


def from_fixed_point(acc: Tensor, scales: Tensor, out: Tensor | None = None, accumulate: bool = False,
                     dtype: torch.dtype = torch.float32) -> Tensor:
    """The int64 sums ``acc`` as floats: ``acc * 2**-e`` (one rounding to fp32, then to ``dtype`` / ``out``'s
    dtype). With ``out``: written into it, or added to it with ``accumulate``; NaN everywhere if the bound was not
    finite."""
    val = acc.to(torch.float32).mul_(scales[1]).add_(scales[2])
    if out is None:
        return val.to(dtype)
    if accumulate:
        out.add_(val)
    else:
        out.copy_(val)
    return out
