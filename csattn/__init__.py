"""csattn: DeepSeek-V4 hybrid attention (sliding window, CSA, HCA) for training on packed sequences."""

from .config import AttentionConfig
from .cp import ContextParallel
from .deterministic import deterministic_mode
from .layers import HybridAttention
from .ops.indexer_loss import IndexerLossAutoScaler
from .ops.rope import YarnScaling
from .packing import PackedSeqs

__all__ = [
    "AttentionConfig", "ContextParallel", "HybridAttention", "IndexerLossAutoScaler", "PackedSeqs", "YarnScaling",
    "deterministic_mode",
]
__version__ = "0.1.0"
