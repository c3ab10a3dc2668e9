"""The older name of :mod:`csattn.capture_safe`, with its older names (``StaticPackedSeqs``, ...), for code written
against it; new code imports :mod:`csattn.capture_safe`."""

from ..capture_safe import *  # noqa: F403
from ..capture_safe import (
    CaptureSafeCompressMeta,
    CaptureSafePackedSeqs,
    CaptureSafeRowMeta,
    indexer_kl_loss_dense_capture_safe,
    indexer_topk_capture_safe,
)
from ..capture_safe import __all__ as _current

StaticPackedSeqs = CaptureSafePackedSeqs
StaticRowMeta = CaptureSafeRowMeta
StaticCompressMeta = CaptureSafeCompressMeta
indexer_topk_static = indexer_topk_capture_safe
indexer_kl_loss_dense_static = indexer_kl_loss_dense_capture_safe

__all__ = [*_current, "StaticPackedSeqs", "StaticRowMeta", "StaticCompressMeta", "indexer_topk_static",
           "indexer_kl_loss_dense_static"]
