"""Interleaved partial rotary embedding on the trailing channels."""

from .naive import apply_rope
from .tables import YarnScaling, rope_cos_sin, rope_inv_freq

__all__ = ["YarnScaling", "apply_rope", "rope_cos_sin", "rope_inv_freq"]
