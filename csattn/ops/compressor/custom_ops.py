"""``torch.library`` custom op for the compressor pooling (fake implementation + backward op), so
``torch.compile`` keeps it as one opaque node."""

from __future__ import annotations

import torch
from torch import Tensor

from ..autograd import autograd_vjp, named_grads
from . import compress_pool as _compress_pool

__all__ = ["compress_pool_op"]


@torch.library.custom_op("csattn::compress_pool", mutates_args=())
def compress_pool_op(
    kv: Tensor, gate: Tensor, position_bias: Tensor, entry_row: Tensor, entry_first: Tensor, ratio: int,
    overlap: bool, backend: str,
) -> Tensor:
    """``[Nc, c]`` entries: :func:`csattn.ops.compressor.compress_pool` as one op."""
    with torch.no_grad():
        return _compress_pool(kv, gate, position_bias, entry_row, entry_first, ratio, overlap, backend=backend)


@compress_pool_op.register_fake
def _(kv, gate, position_bias, entry_row, entry_first, ratio, overlap, backend):
    c = kv.shape[-1] // (2 if overlap else 1)
    return kv.new_empty((entry_row.shape[0], c))


@torch.library.custom_op("csattn::compress_pool_bwd", mutates_args=())
def compress_pool_bwd_op(
    kv: Tensor, gate: Tensor, position_bias: Tensor, entry_row: Tensor, entry_first: Tensor, ratio: int,
    overlap: bool, backend: str, dout: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dkv, dgate, dposition_bias)`` by recomputation."""
    def fwd(kv_, gate_, pb_):
        return _compress_pool(kv_, gate_, pb_, entry_row, entry_first, ratio, overlap, backend=backend)

    dkv, dgate, dpb = autograd_vjp(fwd, (kv, gate, position_bias), (True, True, True), (dout,))
    return dkv, dgate, dpb


@compress_pool_bwd_op.register_fake
def _(kv, gate, position_bias, entry_row, entry_first, ratio, overlap, backend, dout):
    return torch.empty_like(kv), torch.empty_like(gate), torch.empty_like(position_bias)


def _setup(ctx, inputs, output):
    kv, gate, position_bias, entry_row, entry_first, ratio, overlap, backend = inputs
    ctx.save_for_backward(kv, gate, position_bias, entry_row, entry_first)
    ctx.args = (ratio, overlap, backend)


def _backward(ctx, dout):
    kv, gate, position_bias, entry_row, entry_first = ctx.saved_tensors
    dkv, dgate, dpb = compress_pool_bwd_op(kv, gate, position_bias, entry_row, entry_first, *ctx.args, dout)
    return _Grads(kv=dkv, gate=dgate, position_bias=dpb)


_Grads = named_grads(compress_pool_op)
compress_pool_op.register_autograd(_backward, setup_context=_setup)
