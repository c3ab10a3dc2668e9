"""``torch.library`` custom op for the capture-safe indexer top-k (static chunks, no host sync), with a fake
implementation so ``torch.compile`` keeps it as one opaque node. The ids carry no gradient."""

from __future__ import annotations

import torch
from torch import Tensor

from .capture_safe import indexer_topk_capture_safe
from .config import IndexerConfig

__all__ = ["indexer_topk_capture_safe_op"]


@torch.library.custom_op("csattn::indexer_topk_capture_safe", mutates_args=())
def indexer_topk_capture_safe_op(
    q: Tensor, w: Tensor, k: Tensor, vis_start: Tensor, vis_end: Tensor, topk: int, width: int,
    workspace_bytes: int, backend: str, config: str = "",
) -> Tensor:
    """``[T, topk]`` int64 ids: :func:`csattn.ops.indexer.capture_safe.indexer_topk_capture_safe` as one op;
    ``config`` is the kernels' :meth:`IndexerConfig.parse` string (custom ops take no dataclasses; "" = the
    defaults)."""
    return indexer_topk_capture_safe(q, w, k, vis_start, vis_end, topk, width, workspace_bytes, backend=backend,
                               config=IndexerConfig.parse(config) if config else None)


@indexer_topk_capture_safe_op.register_fake
def _(q, w, k, vis_start, vis_end, topk, width, workspace_bytes, backend, config=""):
    return q.new_empty((q.shape[0], topk), dtype=torch.int64)
