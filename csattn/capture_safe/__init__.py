"""Capture-safe execution (CUDA graphs, ``torch.compile``): one training step captured in a CUDA graph, and the
names a capture-safe user needs in one place (static packed metadata, the host-sync check, the static ops).

The capture-safe forward itself is the layer's one flow over a capture-safe plan (``csattn/layers/plan.py``,
``csattn/cp/capture_safe_plan.py``)."""

from ..nosync import HostSyncError, NoHostSync
from ..ops.indexer.capture_safe import indexer_topk_capture_safe
from ..ops.indexer_loss.capture_safe import indexer_kl_loss_dense_capture_safe
from ..packing_capture_safe import (
    CaptureSafeCompressMeta,
    CaptureSafePackedSeqs,
    CaptureSafeRowMeta,
    compressed_capacity,
)
from .capture import CapturedLayerStep

__all__ = [
    "CaptureSafePackedSeqs", "CaptureSafeRowMeta", "CaptureSafeCompressMeta", "compressed_capacity",
    "indexer_topk_capture_safe", "indexer_kl_loss_dense_capture_safe",
    "NoHostSync", "HostSyncError", "CapturedLayerStep",
]
