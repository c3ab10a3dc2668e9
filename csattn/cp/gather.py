"""All-gather of rows over the CP group whose backward is a reduce-scatter (sum of every rank's gradient of
this rank's rows), in a blocking and an asynchronous form.

The asynchronous form launches the collective, lets the caller do independent work, and only then wraps
the received buffer in the autograd function; the backward runs the reduce-scatter synchronously.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["gather_rows", "start_gather_rows", "PendingGather", "all_gather_into", "reduce_scatter_sum"]

# torch >= 2.13 renames the tensor collectives; older releases (e.g. 2.11) only have the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: Tensor, inp: Tensor, group: Any, async_op: bool = False):
    """``out [P * n, ...]`` <- every rank's ``inp [n, ...]``, rank-major."""
    return _ALL_GATHER(out, inp, group=group, async_op=async_op)


def reduce_scatter_sum(out: Tensor, inp: Tensor, group: Any) -> None:
    """``out [n, ...]`` <- sum over ranks of their ``inp[rank * n : (rank + 1) * n]``."""
    _REDUCE_SCATTER(out, inp, group=group)


class _GatheredRows(torch.autograd.Function):
    """Identity from an already all-gathered buffer; links it to the local rows for the backward."""

    @staticmethod
    def forward(ctx, local: Tensor, gathered: Tensor, group: Any) -> Tensor:
        ctx.group = group
        ctx.rows = local.shape[0]
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        out = grad.new_empty((ctx.rows, *grad.shape[1:]))
        reduce_scatter_sum(out, grad, ctx.group)
        return out, None, None


@dataclass
class PendingGather:
    """An all-gather in flight; :meth:`wait` returns the differentiable ``[P * n, ...]`` result."""

    local: Tensor
    buffer: Tensor
    group: Any
    work: Any

    def wait(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
        return _GatheredRows.apply(self.local, self.buffer, self.group)


def start_gather_rows(local: Tensor, group: Any) -> PendingGather:
    """Launch the all-gather of ``local [n, ...]`` (same ``n`` on every rank) without waiting."""
    size = dist.get_world_size(group)
    send = local.detach().contiguous()
    buffer = send.new_empty((size * send.shape[0], *send.shape[1:]))
    work = all_gather_into(buffer, send, group, async_op=True)
    return PendingGather(local, buffer, group, work)


def gather_rows(local: Tensor, group: Any) -> Tensor:
    """Blocking, differentiable all-gather: ``[n, ...]`` on every rank -> ``[P * n, ...]`` rank-major."""
    return start_gather_rows(local, group).wait()
