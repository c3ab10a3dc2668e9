"""Capture-safe execution (CUDA graphs, ``torch.compile``): one training step captured in a CUDA graph, and the
names a capture-safe user needs in one place (static packed metadata, the host-sync check, the static ops).

The capture-safe forward itself is the layer's one flow over a capture-safe plan (``csattn/layers/plan.py``,
``csattn/cp/static_plan.py``)."""

from ..nosync import HostSyncError, NoHostSync
from ..ops.indexer.static import indexer_topk_static
from ..ops.indexer_loss.static import indexer_kl_loss_dense_static
from ..packing_static import StaticCompressMeta, StaticPackedSeqs, StaticRowMeta, compressed_capacity
from .capture import CapturedLayerStep

__all__ = [
    "StaticPackedSeqs", "StaticRowMeta", "StaticCompressMeta", "compressed_capacity",
    "indexer_topk_static", "indexer_kl_loss_dense_static",
    "NoHostSync", "HostSyncError", "CapturedLayerStep",
]
