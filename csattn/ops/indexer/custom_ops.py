"""``torch.library`` custom op for the capture-safe indexer top-k (static chunks, no host sync), with a fake
implementation so ``torch.compile`` keeps it as one opaque node. The ids carry no gradient."""

from __future__ import annotations

import torch
from torch import Tensor

from .config import IndexerConfig
from .static import indexer_topk_static

__all__ = ["indexer_topk_static_op"]


@torch.library.custom_op("csattn::indexer_topk_static", mutates_args=())
def indexer_topk_static_op(
    q: Tensor, w: Tensor, k: Tensor, vis_start: Tensor, vis_end: Tensor, topk: int, width: int,
    workspace_bytes: int, backend: str, config: str = "",
) -> Tensor:
    """``[T, topk]`` int64 ids: :func:`csattn.ops.indexer.static.indexer_topk_static` as one op; ``config`` is the
    kernels' :meth:`IndexerConfig.parse` string (custom ops take no dataclasses; "" = the defaults)."""
    return indexer_topk_static(q, w, k, vis_start, vis_end, topk, width, workspace_bytes, backend=backend,
                               config=IndexerConfig.parse(config) if config else None)


@indexer_topk_static_op.register_fake
def _(q, w, k, vis_start, vis_end, topk, width, workspace_bytes, backend, config=""):
    return q.new_empty((q.shape[0], topk), dtype=torch.int64)
