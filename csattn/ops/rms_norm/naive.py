"""Reference RMSNorm: the plain autograd form, ``w * x / sqrt(mean(x^2) + eps)`` over the last dimension in fp32
(fp64 for fp64 input), cast back once. It saves an fp32 copy of its input and the normed rows for the backward:
the oracle of the tests, not what the layers run (``csattn.ops.rms_norm.rms_norm``)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rms_norm_ref"]


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``[..., C]`` in ``x.dtype``: ``weight [C] * x / sqrt(mean(x^2) + eps)``, the weight applied before the cast."""
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(compute) * h).to(x.dtype)
