"""Context parallelism: one packed stream split over a ``torch.distributed`` process group."""

from .context import ContextParallel
from .launch import free_port
from .partition import PARTITIONS, Layout, flop_imbalance, halo_rows, make_layout, partition_flops, row_flops

__all__ = [
    "ContextParallel",
    "PARTITIONS",
    "Layout",
    "make_layout",
    "halo_rows",
    "row_flops",
    "partition_flops",
    "flop_imbalance",
    "free_port",
]
