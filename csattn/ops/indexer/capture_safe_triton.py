"""Fused indexer top-k over static chunks: the kernels of ``csattn.ops.indexer.triton`` driven by host ints
that do not depend on the pack (row chunks of one height, the whole key table as the slab, the static bound
on the visible range), so the launch sequence is the same on every replay."""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import interpreting
from .triton import _MAX_WORKSPACE, _compute_dtype, indexer_scores_fwd, select_topk

__all__ = ["indexer_topk_capture_safe_triton"]


@torch.no_grad()
def indexer_topk_capture_safe_triton(
    q: Tensor, w: Tensor, k: Tensor, vis_start: Tensor, vis_end: Tensor, topk: int, width: int,
    workspace_bytes: int = 1 << 30, config=None,
) -> Tensor:
    """Same contract as :func:`csattn.ops.indexer.capture_safe.indexer_topk_capture_safe` (fused kernels, CUDA or the
    interpreter); ``config``: an ``IndexerConfig`` (None: the defaults)."""
    interpret = interpreting()
    if not q.is_cuda and not interpret:
        raise ValueError("indexer_topk_capture_safe_triton needs CUDA tensors (or TRITON_INTERPRET=1)")
    num_rows, num_keys = q.shape[0], k.shape[0]
    if num_rows == 0 or num_keys == 0 or width < 1:
        return torch.full((num_rows, topk), -1, dtype=torch.int64, device=q.device)
    out = torch.empty((num_rows, topk), dtype=torch.int64, device=q.device)  # the selection writes every slot
    dtype = _compute_dtype(q, k)
    q, k = q.to(dtype).contiguous(), k.to(dtype).contiguous()
    w = w.float().contiguous()
    vis_start = vis_start.to(torch.int64).contiguous()
    vis_end = vis_end.to(torch.int64).contiguous()
    budget = max(1, min(workspace_bytes, _MAX_WORKSPACE))
    # the slab is the whole key table (the score kernel skips tiles no row of the chunk sees)
    height = max(64, budget // (4 * num_keys) // 64 * 64)
    workspace = torch.empty(min(height, num_rows) * num_keys, dtype=torch.int32, device=q.device)
    for lo in range(0, num_rows, height):
        hi = min(lo + height, num_rows)
        scores = workspace[: (hi - lo) * num_keys].view(hi - lo, num_keys)
        indexer_scores_fwd(q, w, k, vis_start, vis_end, lo, hi, 0, num_keys, out=scores, ordered_keys=True,
                           config=config)
        select_topk(scores, vis_start, vis_end, out, lo, 0, width, config=config)
    return out
