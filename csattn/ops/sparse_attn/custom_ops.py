"""``torch.library`` custom ops for sparse attention, so ``torch.compile`` sees one opaque node (with a fake
implementation for shapes and an explicit backward op) instead of tracing the chunk loop of the reference or
the Triton launch code.

The backward op recomputes the forward of the chosen backend under autograd and back-propagates through
it, which gives exactly the gradients of the eager path (the reference checkpoints its chunks the same way).
:func:`autograd_vjp` is that recipe, shared by the other ops' ``custom_ops.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from . import sparse_attn as _sparse_attn
from .naive import sparse_attn_chunk

__all__ = ["sparse_attn_op", "autograd_vjp", "recording_autograd"]

_K = torch._C.DispatchKey
_AUTOGRAD_KEYS = (_K.AutogradOther, _K.AutogradNestedTensor, _K.AutogradCPU, _K.AutogradCUDA)


@contextmanager
def recording_autograd():
    """Record autograd inside a custom op's implementation.

    A custom op's implementation runs below the autograd dispatch key (it is excluded in the thread-local
    state), so ``torch.autograd.grad`` would see no graph. Lifting the exclusion for this block, with grad
    mode on, lets a backward op differentiate the forward it recomputes.
    """
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def autograd_vjp(
    fn: Callable[..., Tensor | Sequence[Tensor]],
    inputs: Sequence[Tensor],
    differentiable: Sequence[bool],
    grad_outputs: Sequence[Tensor | None],
) -> list[Tensor]:
    """Gradients of ``fn(*inputs)`` w.r.t. the ``differentiable`` inputs (zeros for the others).

    ``grad_outputs`` pairs with ``fn``'s outputs; a ``None`` gradient (an output nobody used) is skipped.
    """
    with recording_autograd():
        leaves = [t.detach().requires_grad_(d) for t, d in zip(inputs, differentiable)]
        outs = fn(*leaves)
        outs = (outs,) if isinstance(outs, Tensor) else tuple(outs)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
        wrt = [t for t in leaves if t.requires_grad]
        grads = iter(())
        if pairs and wrt:
            grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))
    result = []
    for t in leaves:
        g = next(grads, None) if t.requires_grad else None
        result.append(torch.zeros_like(t) if g is None else g.detach())
    return result


@torch.library.custom_op("csattn::sparse_attn", mutates_args=())
def sparse_attn_op(
    q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float, chunk_rows: int, backend: str
) -> tuple[Tensor, Tensor]:
    """``(o [T, H, d], lse [T, H])``: :func:`csattn.ops.sparse_attn.sparse_attn` as one op."""
    with torch.no_grad():
        return _sparse_attn(q, kv, indices, sink, scale, chunk_rows=chunk_rows, backend=backend)


@sparse_attn_op.register_fake
def _(q, kv, indices, sink, scale, chunk_rows, backend):
    compute = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=compute)


@torch.library.custom_op("csattn::sparse_attn_bwd", mutates_args=())
def sparse_attn_bwd_op(
    q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float, chunk_rows: int, backend: str,
    do: Tensor, dlse: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dkv, dsink)`` of :func:`sparse_attn_op` by recomputation.

    The reference is recomputed and differentiated one row chunk at a time (what its checkpointed backward
    does), without ``torch.utils.checkpoint``, whose RNG-state bookkeeping is not allowed in CUDA graph capture.
    """
    if backend != "reference":
        def fwd(q_, kv_, sink_):
            return _sparse_attn(q_, kv_, indices, sink_, scale, chunk_rows=chunk_rows, backend=backend)

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
def _(q, kv, indices, sink, scale, chunk_rows, backend, do, dlse):
    return torch.empty_like(q), torch.empty_like(kv), torch.empty_like(sink)


def _setup(ctx, inputs, output):
    q, kv, indices, sink, scale, chunk_rows, backend = inputs
    ctx.save_for_backward(q, kv, indices, sink)
    ctx.args = (scale, chunk_rows, backend)


def _backward(ctx, do, dlse):
    q, kv, indices, sink = ctx.saved_tensors
    scale, chunk_rows, backend = ctx.args
    if do is None:
        do = torch.zeros_like(q)
    if dlse is None:
        dlse = torch.zeros(q.shape[:2], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    dq, dkv, dsink = sparse_attn_bwd_op(q, kv, indices, sink, scale, chunk_rows, backend, do, dlse)
    return dq, dkv, None, dsink, None, None, None


sparse_attn_op.register_autograd(_backward, setup_context=_setup)
