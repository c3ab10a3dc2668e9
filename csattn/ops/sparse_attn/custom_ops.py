"""``torch.library`` custom ops for sparse attention, so ``torch.compile`` sees one opaque node (with a fake
implementation for shapes and an explicit backward op) instead of tracing the chunk loop of the reference or
the Triton launch code.

The backward op recomputes the forward of the chosen backend under autograd and back-propagates through
it, which gives exactly the gradients of the eager path (the reference checkpoints its chunks the same way):
:func:`csattn.ops.autograd.autograd_vjp`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..autograd import autograd_vjp, named_grads
from . import sparse_attn as _sparse_attn
from .config import SparseAttnConfig
from .naive import sparse_attn_chunk

__all__ = ["sparse_attn_op"]


def _config(spec: str) -> SparseAttnConfig | None:
    """The op's ``config`` argument: a :meth:`SparseAttnConfig.parse` string (custom ops take no dataclasses)."""
    return SparseAttnConfig.parse(spec) if spec else None


@torch.library.custom_op("csattn::sparse_attn", mutates_args=())
def sparse_attn_op(
    q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float, chunk_rows: int, backend: str,
    config: str = "",
) -> tuple[Tensor, Tensor]:
    """``(o [T, H, d], lse [T, H])``: :func:`csattn.ops.sparse_attn.sparse_attn` as one op; ``config`` is the
    fused kernels' :class:`SparseAttnConfig` as a ``parse`` string (``SparseAttnConfig.spec()``, "" = defaults)."""
    with torch.no_grad():
        return _sparse_attn(q, kv, indices, sink, scale, chunk_rows=chunk_rows, backend=backend,
                            config=_config(config))


@sparse_attn_op.register_fake
def _(q, kv, indices, sink, scale, chunk_rows, backend, config=""):
    compute = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=compute)


@torch.library.custom_op("csattn::sparse_attn_bwd", mutates_args=())
def sparse_attn_bwd_op(
    q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float, chunk_rows: int, backend: str,
    do: Tensor, dlse: Tensor, config: str = "",
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dkv, dsink)`` of :func:`sparse_attn_op` by recomputation.

    The reference is recomputed and differentiated one row chunk at a time (what its checkpointed backward
    does), without ``torch.utils.checkpoint``, whose RNG-state bookkeeping is not allowed in CUDA graph capture.
    """
    if backend != "reference":
        def fwd(q_, kv_, sink_):
            return _sparse_attn(q_, kv_, indices, sink_, scale, chunk_rows=chunk_rows, backend=backend,
                                config=_config(config))

        dq, dkv, dsink = autograd_vjp(fwd, (q, kv, sink), (True, True, True), (do, dlse))
        return dq, dkv, dsink
    dq, dkv, dsink = torch.zeros_like(q), torch.zeros_like(kv), torch.zeros_like(sink)
    for lo in range(0, q.shape[0], max(1, chunk_rows)):
        hi = min(lo + max(1, chunk_rows), q.shape[0])

        def chunk(q_, kv_, sink_, lo=lo, hi=hi):
            return sparse_attn_chunk(q_, kv_, indices[lo:hi], sink_, scale)

        g_q, g_kv, g_sink = autograd_vjp(chunk, (q[lo:hi], kv, sink), (True, True, True), (do[lo:hi], dlse[lo:hi]))
        dq[lo:hi] = g_q
        dkv += g_kv
        dsink += g_sink
    return dq, dkv, dsink


@sparse_attn_bwd_op.register_fake
def _(q, kv, indices, sink, scale, chunk_rows, backend, do, dlse, config=""):
    return torch.empty_like(q), torch.empty_like(kv), torch.empty_like(sink)


def _setup(ctx, inputs, output):
    q, kv, indices, sink, scale, chunk_rows, backend, config = inputs
    ctx.save_for_backward(q, kv, indices, sink)
    ctx.args = (scale, chunk_rows, backend, config)


def _backward(ctx, do, dlse):
    q, kv, indices, sink = ctx.saved_tensors
    scale, chunk_rows, backend, config = ctx.args
    if do is None:
        do = torch.zeros_like(q)
    if dlse is None:
        dlse = torch.zeros(q.shape[:2], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    dq, dkv, dsink = sparse_attn_bwd_op(q, kv, indices, sink, scale, chunk_rows, backend, do, dlse, config)
    return _Grads(q=dq, kv=dkv, sink=dsink)


_Grads = named_grads(sparse_attn_op)
sparse_attn_op.register_autograd(_backward, setup_context=_setup)
