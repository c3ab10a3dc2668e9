"""Reference interleaved partial RoPE on the trailing channels (the tables: ``tables.py``)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["apply_rope"]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` in interleaved pairs (2i, 2i+1).

    Args:
        x: ``[n, C]`` or ``[n, H, C]``.
        cos, sin: ``[n, p/2]`` tables for each row of ``x``.
        inverse: rotate by the negative angle (used on the attention output, whose values carried rope).

    Returns:
        Same shape and dtype as ``x``; the leading ``C - p`` channels are untouched.
    """
    half = cos.shape[-1]
    p = 2 * half
    if x.shape[-1] < p:
        raise ValueError(f"x has {x.shape[-1]} channels, fewer than the {p} rope channels")
    compute = torch.promote_types(x.dtype, torch.float32)
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    cos = cos.to(compute)
    sin = -sin.to(compute) if inverse else sin.to(compute)
    rope = x[..., -p:].to(compute).unflatten(-1, (half, 2))
    even, odd = rope[..., 0], rope[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-p], rotated.to(x.dtype)], dim=-1)
