"""Interleaved partial RoPE on the trailing channels (plain and YaRN tables, no mscale)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["YarnScaling", "rope_inv_freq", "rope_cos_sin", "apply_rope"]


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency interpolation (DeepSeek-V4: factor 16, original 65536, beta 32 / 1).

    The YaRN attention factor (mscale) is deliberately not applied: the V4 reference does not scale cos/sin.
    """

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


def rope_inv_freq(rope_dim: int, theta: float, yarn: YarnScaling | None = None) -> Tensor:
    """Inverse frequencies ``[rope_dim // 2]`` (fp32), one per interleaved channel pair.

    Computed in fp32 exactly like the released checkpoints' reference code, so tables match bit for bit.
    """
    if rope_dim % 2:
        raise ValueError(f"rope_dim must be even, got {rope_dim}")
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    inv_freq = 1.0 / pos_freqs
    if yarn is None:
        return inv_freq

    def correction_dim(num_rotations: float) -> float:
        orig = yarn.original_max_position_embeddings
        return (rope_dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolation = 1.0 / (yarn.factor * pos_freqs)
    return interpolation * (1 - extrapolation) + inv_freq * extrapolation


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[n, rope_dim // 2]`` for integer ``positions [n]``.

    Angles are formed in fp32 (as the reference does) and the tables cast to ``dtype`` once.
    """
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device, torch.float32)[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


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
