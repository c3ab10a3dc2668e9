"""``ContextParallel``: the process group, the partition, and helpers moving rows between the global stream
and a rank's shard."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from ..config import AttentionConfig
from ..layers.plan import LayerPlan, Packed, capture_safe_pack
from ..packing import PackedSeqs
from .capture_safe_plan import build_capture_safe_plan
from .exchange import GatherExchange
from .gather import gather_rows
from .partition import PARTITIONS, Layout, make_layout
from .plan import build_plan, check_inputs

__all__ = ["ContextParallel"]


@dataclass
class ContextParallel:
    """Context parallelism over a ``torch.distributed`` process group.

    Pass it to :class:`csattn.HybridAttention` as ``cp=``; the layer then takes this rank's rows of the packed
    stream (``cp.shard(x_global, packed)``) together with the **global** packed metadata, and returns this
    rank's output rows. Parameter gradients are per-rank partial sums: all-reduce them (as data parallelism
    already does) to get the single-process gradients. The indexer loss of each rank is its share of the
    global mean, so the sum over ranks is the single-process loss.

    Args:
        group: the CP process group (``None`` = the default group). Any backend: NCCL on GPUs, gloo on CPU
            or for several ranks sharing one GPU.
        partition: ``"contiguous"`` (rank r owns rows ``[r*T/P, (r+1)*T/P)``) or ``"balanced"`` (equal
            chunks dealt out so every rank gets the same indexer + attention work; see ``cp/README.md``).
        chunks_per_rank: chunks per rank of the balanced partition.
        cost_config: the geometry whose FLOPs the balanced partition equalizes (default: V4-Flash CSA).
            The layout must be the same for every layer of a stack, so it does not follow each layer.

    Example:
        >>> cp = ContextParallel(group, partition="balanced")          # doctest: +SKIP
        >>> out_local = attn(cp.shard(x, packed), packed=packed, cp=cp)  # doctest: +SKIP
        >>> out = cp.gather(out_local, packed)                           # doctest: +SKIP
    """

    group: dist.ProcessGroup | None = None
    partition: str = "contiguous"
    chunks_per_rank: int = 4
    cost_config: AttentionConfig | None = None

    def __post_init__(self) -> None:
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        if not isinstance(self.chunks_per_rank, int) or self.chunks_per_rank < 1:
            raise ValueError(f"chunks_per_rank must be a positive int, got {self.chunks_per_rank!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("ContextParallel needs an initialized torch.distributed process group")

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def plan(self, x_local: Tensor, packed: Packed, config: AttentionConfig) -> LayerPlan:
        """This rank's plan of one layer call (the planner :class:`csattn.HybridAttention` asks).

        Args:
            x_local: ``[T / P, D]`` this rank's rows of the global stream (``cp.shard(x, packed)``).
            packed: metadata of the whole ``T``-row stream, identical on every rank; a
                :class:`~csattn.packing_capture_safe.CaptureSafePackedSeqs` (or ``config.capture_safe``) asks for the
                capture-safe plan.
            config: the layer's geometry.

        Raises the same ``ValueError`` on every rank on bad input (one collective check).
        """
        if config.capture_safe or getattr(packed, "capture_safe", False):
            pack = capture_safe_pack(packed, x_local.shape[0] * self.size)
            return build_capture_safe_plan(x_local, pack, config, self)
        packed = PackedSeqs.coerce(packed)
        check_inputs(x_local, packed, config, self)
        plan, index = build_plan(packed, config, self, x_local.device)
        return replace(plan, exchange=GatherExchange(index, self.group))

    def layout(self, packed: Packed) -> Layout:
        """Row ownership of the global stream described by ``packed`` (cached on it)."""
        return make_layout(PackedSeqs.coerce(packed), self.partition, self.size, self.chunks_per_rank,
                           self.cost_config)

    def local_rows(self, packed: Packed, device: torch.device | str | None = None) -> Tensor:
        """``[T / P]`` int64 global row index of each local row, in local order."""
        return self.layout(packed).local_rows(self.rank, device)

    def shard(self, tensor: Tensor, packed: Packed) -> Tensor:
        """This rank's rows of a global ``[T, ...]`` tensor (differentiable), ``[T / P, ...]``."""
        layout = self.layout(packed)
        if tensor.shape[0] != layout.num_rows:
            raise ValueError(f"tensor has {tensor.shape[0]} rows but packed describes {layout.num_rows}")
        return torch.cat([tensor[a:b] for a, b in layout.segments(self.rank)], dim=0)

    def gather(self, local: Tensor, packed: Packed) -> Tensor:
        """The global ``[T, ...]`` tensor from every rank's ``[T / P, ...]`` shard (collective).

        Differentiable: the backward sums, over ranks, the gradients of each rank's rows (reduce-scatter).
        """
        layout = self.layout(packed)
        per_rank = layout.num_rows // layout.size
        if local.shape[0] != per_rank:
            raise ValueError(f"local has {local.shape[0]} rows but each rank holds {per_rank}")
        flat = gather_rows(local.reshape(per_rank, -1), self.group)  # [P * L, F] rank-major
        # rank-major position of every global row
        src = torch.empty(layout.num_rows, dtype=torch.int64, device=local.device)
        for r in range(layout.size):
            src[layout.local_rows(r, local.device)] = torch.arange(r * per_rank, (r + 1) * per_rank,
                                                                   device=local.device)
        return flat[src].reshape(layout.num_rows, *local.shape[1:])
