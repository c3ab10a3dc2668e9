"""Reference sparse attention with a per-head sink over per-row key index lists (MQA, K = V)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..indices.naive import gather_rows_masked

__all__ = ["sparse_attn_ref", "sparse_attn_chunk"]


def sparse_attn_chunk(q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """One row chunk: gather ``K`` keys per row and attend.

    Args:
        q: ``[R, H, d]``; kv: ``[N, d]``; indices: ``[R, K]`` int64 (-1 = no key); sink: ``[H]``.

    Returns:
        ``o [R, H, d]`` (q's dtype) and ``lse [R, H]`` (fp32/fp64): log of the full denominator, sink included.
    """
    compute = torch.promote_types(q.dtype, torch.float32)
    valid = indices >= 0
    # empty slots read zeros, not row 0 (another document's row: see gather_rows_masked)
    keys = gather_rows_masked(kv, indices).to(compute)  # [R, K, d]
    scores = torch.einsum("rhd,rkd->rhk", q.to(compute), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink_logit = sink.to(compute)[None, :, None].expand(scores.shape[0], -1, 1)
    logits = torch.cat([scores, sink_logit], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)  # the sink keeps it finite for empty rows
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("rhk,rkd->rhd", probs, keys)
    return out.to(q.dtype), lse


def sparse_attn_ref(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sink: Tensor,
    scale: float,
    chunk_rows: int = 1024,
) -> tuple[Tensor, Tensor]:
    """Sparse attention: ``o[t,h] = sum_j p_j kv[j]``, ``p_j = exp(s_j) / (sum exp(s) + exp(sink_h))``.

    Rows are processed in chunks of ``chunk_rows``; under autograd each chunk is checkpointed, so only
    ``o`` and ``lse`` stay alive and the backward regathers the chunk's keys. A row without keys
    outputs zeros.

    Args:
        q: ``[T, H, d]``; kv: ``[N, d]`` (raw rows then compressed entries); indices: ``[T, K]`` int64;
        sink: ``[H]``; scale: softmax scale (``d^-0.5``).

    Returns:
        ``(o [T, H, d], lse [T, H])``.
    """
    outs, lses = [], []
    for lo in range(0, q.shape[0], chunk_rows):
        hi = min(lo + chunk_rows, q.shape[0])
        args = (q[lo:hi], kv, indices[lo:hi], sink, scale)
        if torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad or sink.requires_grad):
            o, lse = checkpoint(sparse_attn_chunk, *args, use_reentrant=False)
        else:
            o, lse = sparse_attn_chunk(*args)
        outs.append(o)
        lses.append(lse)
    if not outs:
        compute = torch.promote_types(q.dtype, torch.float32)
        return q.new_zeros(q.shape), q.new_zeros(q.shape[:2], dtype=compute)
    return torch.cat(outs), torch.cat(lses)
