"""The layer's recomputed projections (query heads, output projection) as ``torch.library`` custom ops.

``HybridAttention`` recomputes them block by block in the backward through an autograd function that calls
``torch.autograd.grad``, which ``torch.compile`` cannot trace. As custom ops they are opaque nodes with fake
implementations; the forward and the backward ops run that same row-chunked code, so values and gradients
equal the default path's.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from ..ops.autograd import autograd_vjp, named_grads
from ..ops.recompute import row_chunked
from .core import output_projection, query_heads
from .modules import Projection

__all__ = ["query_heads_chunked", "output_chunked", "query_heads_op", "output_proj_op"]


def query_heads_chunked(qr: Tensor, cos: Tensor, sin: Tensor, q_b: Projection, heads: int, eps: float,
                        chunk_rows: int) -> Tensor:
    """:func:`~csattn.layers.core.query_heads` row-chunked (recomputed block by block in the backward), its
    low-rank term factored: gradients reach the weight only if it requires them."""
    fn = partial(_query_rows, heads=heads, eps=eps, scale=q_b.scale)
    return row_chunked(fn, (qr, cos, sin), q_b.tensors(), chunk_rows)


def output_chunked(o: Tensor, cos: Tensor, sin: Tensor, o_a: Projection, o_b: Projection, groups: int,
                   chunk_rows: int) -> Tensor:
    """:func:`~csattn.layers.core.output_projection` row-chunked, as :func:`query_heads_chunked`."""
    fn = partial(_output_rows, groups=groups, split=len(o_a.tensors()), scales=(o_a.scale, o_b.scale))
    return row_chunked(fn, (o, cos, sin), (*o_a.tensors(), *o_b.tensors()), chunk_rows)


def _query_rows(qr, cos, sin, *tensors, heads: int, eps: float, scale: float) -> Tensor:
    return query_heads(qr, cos, sin, Projection.of(tensors, scale), heads, eps)


def _output_rows(o, cos, sin, *tensors, groups: int, split: int, scales: tuple[float, float]) -> Tensor:
    o_a, o_b = Projection.of(tensors[:split], scales[0]), Projection.of(tensors[split:], scales[1])
    return output_projection(o, cos, sin, o_a, o_b, groups)


# The custom ops (the capture-safe path) carry one weight a projection: a low-rank term comes in merged
# (Projection.merged), its gradient through a GEMM of the weight's size

def _query(qr, cos, sin, weight, heads: int, eps: float, chunk_rows: int) -> Tensor:
    return query_heads_chunked(qr, cos, sin, Projection(weight), heads, eps, chunk_rows)


def _output(o, cos, sin, w_a, w_b, groups: int, chunk_rows: int) -> Tensor:
    return output_chunked(o, cos, sin, Projection(w_a), Projection(w_b), groups, chunk_rows)


@torch.library.custom_op("csattn::query_heads", mutates_args=())
def query_heads_op(qr: Tensor, cos: Tensor, sin: Tensor, weight: Tensor, heads: int, eps: float,
                   chunk_rows: int) -> Tensor:
    """``qr [T, q_lora]`` -> ``q [T, H, d]`` (projection, per-head RMSNorm, RoPE), row-chunked."""
    with torch.no_grad():
        return _query(qr, cos, sin, weight, heads, eps, chunk_rows)


@query_heads_op.register_fake
def _(qr, cos, sin, weight, heads, eps, chunk_rows):
    return qr.new_empty((qr.shape[0], heads, weight.shape[0] // heads))


@torch.library.custom_op("csattn::query_heads_bwd", mutates_args=())
def query_heads_bwd_op(qr: Tensor, cos: Tensor, sin: Tensor, weight: Tensor, heads: int, eps: float,
                       chunk_rows: int, grad: Tensor) -> tuple[Tensor, Tensor]:
    """``(dqr, dweight)`` (cos/sin are position tables without gradient)."""
    def fwd(qr_, w_):
        return _query(qr_, cos, sin, w_, heads, eps, chunk_rows)

    dqr, dw = autograd_vjp(fwd, (qr, weight), (True, True), (grad,))
    return dqr, dw


@query_heads_bwd_op.register_fake
def _(qr, cos, sin, weight, heads, eps, chunk_rows, grad):
    return torch.empty_like(qr), torch.empty_like(weight)


def _query_setup(ctx, inputs, output):
    qr, cos, sin, weight, heads, eps, chunk_rows = inputs
    ctx.save_for_backward(qr, cos, sin, weight)
    ctx.args = (heads, eps, chunk_rows)


def _query_backward(ctx, grad):
    qr, cos, sin, weight = ctx.saved_tensors
    dqr, dw = query_heads_bwd_op(qr, cos, sin, weight, *ctx.args, grad)
    return _QueryGrads(qr=dqr, weight=dw)


_QueryGrads = named_grads(query_heads_op)
query_heads_op.register_autograd(_query_backward, setup_context=_query_setup)


@torch.library.custom_op("csattn::output_proj", mutates_args=())
def output_proj_op(o: Tensor, cos: Tensor, sin: Tensor, w_a: Tensor, w_b: Tensor, groups: int,
                   chunk_rows: int) -> Tensor:
    """``o [T, H, d]`` -> ``[T, D]`` (inverse RoPE, grouped ``o_a_proj``, ``o_b_proj``), row-chunked."""
    with torch.no_grad():
        return _output(o, cos, sin, w_a, w_b, groups, chunk_rows)


@output_proj_op.register_fake
def _(o, cos, sin, w_a, w_b, groups, chunk_rows):
    return o.new_empty((o.shape[0], w_b.shape[0]))


@torch.library.custom_op("csattn::output_proj_bwd", mutates_args=())
def output_proj_bwd_op(o: Tensor, cos: Tensor, sin: Tensor, w_a: Tensor, w_b: Tensor, groups: int,
                       chunk_rows: int, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(do, dw_a, dw_b)``."""
    def fwd(o_, a_, b_):
        return _output(o_, cos, sin, a_, b_, groups, chunk_rows)

    do, da, db = autograd_vjp(fwd, (o, w_a, w_b), (True, True, True), (grad,))
    return do, da, db


@output_proj_bwd_op.register_fake
def _(o, cos, sin, w_a, w_b, groups, chunk_rows, grad):
    return torch.empty_like(o), torch.empty_like(w_a), torch.empty_like(w_b)


def _output_setup(ctx, inputs, output):
    o, cos, sin, w_a, w_b, groups, chunk_rows = inputs
    ctx.save_for_backward(o, cos, sin, w_a, w_b)
    ctx.args = (groups, chunk_rows)


def _output_backward(ctx, grad):
    o, cos, sin, w_a, w_b = ctx.saved_tensors
    do, da, db = output_proj_bwd_op(o, cos, sin, w_a, w_b, *ctx.args, grad)
    return _OutputGrads(o=do, w_a=da, w_b=db)


_OutputGrads = named_grads(output_proj_op)
output_proj_op.register_autograd(_output_backward, setup_context=_output_setup)
