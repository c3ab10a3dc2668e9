"""Reference compressor pooling: per-channel softmax over each block's tokens (plus the previous block's
first-half channels when overlapping), weighted sum of the projected values."""

from __future__ import annotations

import torch
from torch import Tensor

from ..indices.naive import take_rows as _take

__all__ = ["compress_pool_ref"]


def compress_pool_ref(
    kv: Tensor,
    gate: Tensor,
    position_bias: Tensor,
    entry_row: Tensor,
    entry_first: Tensor,
    ratio: int,
    overlap: bool,
) -> Tensor:
    """Pool blocks of ``ratio`` rows into compressed entries.

    Args:
        kv: ``[T, coff * c]`` projected values (coff = 2 when ``overlap`` else 1).
        gate: ``[T, coff * c]`` gate logits.
        position_bias: ``[ratio, coff * c]`` added to the gate logits by position inside the block.
        entry_row: ``[Nc]`` int64 first row of each entry's block.
        entry_first: ``[Nc]`` bool, the entry is its document's first (no previous block).
        ratio: block length r.
        overlap: CSA layout. Entry i pools 2r slots: block i-1 with channels ``[:c]`` and block i with
            channels ``[c:]``, one softmax over all 2r slots per channel; block -1 has weight 0.

    Returns:
        ``[Nc, c]`` in ``kv.dtype``. The softmax runs in fp32 (or fp64 for fp64 inputs) and its weights are
        cast to ``kv.dtype`` before the weighted sum, as the reference model does.
    """
    coff = 2 if overlap else 1
    width = kv.shape[-1]
    if width % coff:
        raise ValueError(f"kv width {width} is not divisible by {coff} (overlap={overlap})")
    c = width // coff
    if position_bias.shape != (ratio, width):
        raise ValueError(f"position_bias must be [{ratio}, {width}], got {tuple(position_bias.shape)}")
    soft_dtype = torch.promote_types(gate.dtype, torch.float32)
    rows = entry_row[:, None] + torch.arange(ratio, device=kv.device)[None, :]  # [Nc, r]
    cur_kv = _take(kv, rows)  # [Nc, r, coff*c]
    cur_gate = _take(gate, rows).to(soft_dtype) + position_bias.to(soft_dtype)
    if not overlap:
        weights = cur_gate.softmax(dim=1).to(kv.dtype)
        return (cur_kv * weights).sum(dim=1)
    prev_rows = (rows - ratio).clamp_(min=0)
    prev_kv = _take(kv, prev_rows)[..., :c]
    prev_gate = _take(gate, prev_rows)[..., :c].to(soft_dtype) + position_bias[:, :c].to(soft_dtype)
    first = entry_first[:, None, None]
    prev_kv = prev_kv.masked_fill(first, 0.0)
    prev_gate = prev_gate.masked_fill(first, float("-inf"))
    slots_kv = torch.cat([prev_kv, cur_kv[..., c:]], dim=1)  # [Nc, 2r, c]
    slots_gate = torch.cat([prev_gate, cur_gate[..., c:]], dim=1)
    weights = slots_gate.softmax(dim=1).to(kv.dtype)
    return (slots_kv * weights).sum(dim=1)
