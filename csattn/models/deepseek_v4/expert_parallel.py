"""Expert parallelism: the routed experts split over a process group, tokens exchanged around the grouped GEMMs.

Rank ``r`` of an ``ep``-rank group holds experts ``[r * E / ep, (r + 1) * E / ep)``. One MoE call on each rank:

1. **route**: the router picks ``k`` experts per local row (all ranks alike, global expert ids);
2. **dispatch**: the ``N = T * k`` assignments sorted by expert are cut into one run per destination rank and
   sent with ``all_to_all_single`` (rows and their routing weights); each rank learns how many rows every
   source sends to each of its experts from one small ``all_to_all_single`` of the per-expert counts, made
   before the row exchange;
3. **experts**: the received rows run through the local experts' grouped GEMMs (:func:`csattn.ops.moe.moe_experts`),
   weighted by their routing weights;
4. **combine**: the results go back with the reverse ``all_to_all_single`` and each row sums its ``k`` results.

The split sizes of ``all_to_all_single`` are host integers, so step 2 reads the exchanged counts on the host: one
device-to-host sync per MoE call, which no exchange of variable-size token runs avoids. A capture-safe (CUDA
graph) step cannot hold it: :meth:`ExpertParallel.check_capture` refuses that combination by name.

Every rank of the group must call the MoE the same number of times in the same order (the training loop gives
every rank the same number of rows); a rank that receives no rows still takes part and gets zero gradients for
its experts, so FSDP's gradient reduction sees the same parameters on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ExpertParallel", "all_to_all_rows"]


@dataclass
class ExpertParallel:
    """The expert-parallel group of one MoE (the model takes it; ``csattn.parallel`` builds it from the mesh).

    Args:
        group: the process group the experts are split over (every rank of it holds ``num_experts / size``).
        num_experts: experts of the layer (all ranks together).
    """

    group: Any
    num_experts: int

    def __post_init__(self) -> None:
        if self.num_experts % self.size:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by the expert-parallel size "
                             f"({self.size}): pick an --ep that divides the expert count")

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def local_experts(self) -> range:
        """Global ids of the experts this rank holds."""
        n = self.num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @staticmethod
    def check_capture(capture_safe: bool) -> None:
        if capture_safe:
            raise ValueError("expert parallelism exchanges a data-dependent number of tokens per expert (a host "
                             "read of the split sizes each MoE call), which a captured CUDA graph cannot replay: "
                             "use ep = 1 with the capture-safe mode, or the eager step with ep > 1")


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows; the backward sends the gradients back along the reverse splits."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group: Any) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return out, None, None, None


def all_to_all_rows(x: Tensor, send: list[int], recv: list[int], group: Any) -> Tensor:
    """Differentiable ``all_to_all_single`` of ``x [sum(send), ...]`` -> ``[sum(recv), ...]``."""
    return _AllToAll.apply(x, send, recv, group)


def exchange_counts(counts: Tensor, ep: ExpertParallel) -> tuple[Tensor, list[int], list[int]]:
    """Per-expert row counts of this rank ``[E]`` -> (``[ep, E / ep]`` rows each source sends to each local
    expert, rows sent to each rank, rows received from each rank). The one host read of the MoE call."""
    n_local = ep.num_experts // ep.size
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts.contiguous(), group=ep.group)
    both = torch.stack([counts.view(ep.size, n_local).sum(1), recv.view(ep.size, n_local).sum(1)]).tolist()
    return recv.view(ep.size, n_local), both[0], both[1]
