"""RoPE tables: inverse frequencies (plain and YaRN, no mscale) and cos / sin per position, as the released
checkpoints' reference code computes them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["YarnScaling", "rope_cos_sin", "rope_inv_freq"]


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
