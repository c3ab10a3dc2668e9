"""Capture-safe execution (CUDA graphs, ``torch.compile``): static packed metadata built on the device from
``cu_seqlens``, a forward of the attention layer without host syncs, and a dispatch mode that checks it."""

from .capture import CapturedLayerStep
from .cp_forward import capture_safe_cp_forward
from .forward import capture_safe_forward, capture_safe_forward_packed
from .nosync import HostSyncError, NoHostSync
from .select import indexer_kl_loss_dense_static, indexer_topk_static
from .static import StaticCompressMeta, StaticPackedSeqs, StaticRowMeta, compressed_capacity

__all__ = [
    "StaticPackedSeqs", "StaticRowMeta", "StaticCompressMeta", "compressed_capacity",
    "capture_safe_forward", "capture_safe_forward_packed", "capture_safe_cp_forward",
    "indexer_topk_static", "indexer_kl_loss_dense_static",
    "NoHostSync", "HostSyncError", "CapturedLayerStep",
]
