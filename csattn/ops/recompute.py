"""Row-chunked recomputation: a row-wise function computed block by block and recomputed block by block in
the backward (the memory of ``torch.utils.checkpoint`` per block, without its RNG bookkeeping, which CUDA-graph
capture forbids). Used for the layer's per-head projections and the indexer loss's student.

The query head path (``q_b_proj`` -> per-head RMSNorm -> RoPE) and the output path (inverse RoPE -> grouped
``o_a_proj`` -> ``o_b_proj``) create several ``[T, H, d]`` temporaries, some in fp32, that plain autograd
keeps until the backward: about 0.4 MiB per row at H = 64, d = 512. Here the forward runs without saving
any of them, and the backward recomputes each block of rows and back-propagates through it, so only the
small inputs stay alive (``qr`` for the query path; ``o``, which sparse attention keeps anyway, for the
output path) and the temporaries never exceed one block of rows.

Rebuilt saves (:func:`rebuilt_saves`): one tensor that several consumers would each keep for their backward is
dropped from all their saved tensors and rebuilt once in the backward from what is kept anyway (the model's
normed block inputs, from the streams).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor

__all__ = ["row_chunked", "rebuilt_saves", "NoCtx"]


class _RowChunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, chunk_rows: int, num_rows_inputs: int, *tensors: Tensor) -> Tensor:
        rows, params = tensors[:num_rows_inputs], tensors[num_rows_inputs:]
        ctx.fn, ctx.chunk_rows, ctx.num_rows_inputs = fn, chunk_rows, num_rows_inputs
        ctx.save_for_backward(*tensors)
        total = rows[0].shape[0]
        with torch.no_grad():
            if total <= chunk_rows:
                return fn(*rows, *params)
            # each block is written into the output as it is made: never the blocks and their concatenation
            first = fn(*(r[:chunk_rows] for r in rows), *params)
            out = first.new_empty((total, *first.shape[1:]))
            out[:chunk_rows] = first
            del first
            for lo in range(chunk_rows, total, chunk_rows):
                out[lo:lo + chunk_rows] = fn(*(r[lo:lo + chunk_rows] for r in rows), *params)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        tensors = ctx.saved_tensors
        n = ctx.num_rows_inputs
        rows, params = tensors[:n], tensors[n:]
        needs = ctx.needs_input_grad[3:]
        row_grads = [torch.empty_like(r) if need else None for r, need in zip(rows, needs[:n])]
        # parameter gradients accumulate over blocks in fp32 (fp64 for fp64 parameters)
        param_grads = [
            torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) if need else None
            for p, need in zip(params, needs[n:])
        ]
        total, step = rows[0].shape[0], ctx.chunk_rows
        for lo in range(0, total, step):
            hi = min(lo + step, total)
            with torch.enable_grad():
                r_in = [r[lo:hi].detach().requires_grad_(need) for r, need in zip(rows, needs[:n])]
                p_in = [p.detach().requires_grad_(need) for p, need in zip(params, needs[n:])]
                out = ctx.fn(*r_in, *p_in)
                wrt = [t for t in (*r_in, *p_in) if t.requires_grad]
                grads = iter(torch.autograd.grad(out, wrt, grad_out[lo:hi], allow_unused=True)) if wrt else iter(())
            for i, t in enumerate(r_in):
                if t.requires_grad:
                    g = next(grads)
                    row_grads[i][lo:hi] = 0 if g is None else g
            for i, t in enumerate(p_in):
                if t.requires_grad:
                    g = next(grads)
                    if g is not None:
                        param_grads[i] += g
        param_grads = [g.to(p.dtype) if g is not None else None for g, p in zip(param_grads, params)]
        return (None, None, None, *row_grads, *param_grads)


def row_chunked(fn: Callable[..., Tensor], rows: Sequence[Tensor], params: Sequence[Tensor],
                chunk_rows: int) -> Tensor:
    """``fn(*rows, *params)`` computed block by block of ``chunk_rows`` rows, recomputed in the backward.

    Args:
        fn: a row-wise function (row t of the output depends only on row t of every ``rows`` tensor).
        rows: tensors whose first dimension is the row dimension ``T``.
        params: tensors shared by all rows (weights, biases).
        chunk_rows: rows per block.

    Returns:
        The output of ``fn`` on all rows, ``[T, ...]``.
    """
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (*rows, *params)):
        return _RowChunked.forward(NoCtx(), fn, max(1, chunk_rows), len(rows), *rows, *params)
    return _RowChunked.apply(fn, max(1, chunk_rows), len(rows), *rows, *params)


class NoCtx:
    """Stand-in context for calling an autograd function's forward without autograd."""

    def save_for_backward(self, *tensors: Tensor) -> None:
        pass


class _Rebuilt:
    """What a dropped save keeps: its owner and its geometry in the owner's storage."""

    __slots__ = ("owner", "size", "stride", "offset")

    def __init__(self, owner: _RebuiltSaves, t: Tensor) -> None:
        self.owner, self.size, self.stride, self.offset = owner, t.size(), t.stride(), t.storage_offset()


class _RebuiltSaves:
    def __init__(self, x: Tensor, again: Callable[[], Tensor]) -> None:
        self.key = (x.untyped_storage().data_ptr(), x.dtype, x.device)
        self.shape, self.again = x.shape, again
        self.value: Tensor | None = None
        self.pending = 0

    def pack(self, t: Tensor) -> Tensor | _Rebuilt:
        if (t.untyped_storage().data_ptr(), t.dtype, t.device) != self.key:
            return t
        self.pending += 1
        return _Rebuilt(self, t)

    def unpack(self, p: Tensor | _Rebuilt) -> Tensor:
        if not isinstance(p, _Rebuilt):
            return p
        if self.value is None:
            with torch.no_grad():
                value = self.again()
            if value.shape != self.shape or not value.is_contiguous() or value.storage_offset():
                raise RuntimeError(f"rebuilt_saves: again() gave {tuple(value.shape)} (contiguous "
                                   f"{value.is_contiguous()}), the dropped tensor was {tuple(self.shape)} contiguous")
            self.value = value
        out = self.value.as_strided(p.size, p.stride, p.offset)
        self.pending -= 1
        if self.pending <= 0:  # every consumer has its copy: the rebuilt tensor lives no longer than they need it
            self.value = None
        return out


def rebuilt_saves(x: Tensor, again: Callable[[], Tensor] | None) -> AbstractContextManager:
    """Saved-tensor hooks under which ``x`` is not kept for the backward by the ops run inside: every tensor saved
    there that is ``x`` or a view of its storage is replaced by its geometry, and the backward rebuilds ``x`` once
    with ``again()`` (no autograd) for all of them, then lets it go.

    For a tensor that is cheap to redo from what the backward keeps anyway, consumed by several ops that would
    each keep it: an mHC site's normed block input (from the streams the site keeps, read once more), the first
    block's streams (from the embedding). ``again()`` must return ``x`` bit for bit (the same kernels on the same
    inputs), contiguous; ``x`` must be contiguous and own its storage from offset 0. Only the innermost hooks
    apply: ops inside that install their own (``torch.utils.checkpoint``) keep what they keep. Do not use inside a
    non-reentrant checkpoint (its recomputation would see other saves than its forward did).

    Returns a null context when ``again`` is None, autograd is off or ``x`` is not such a tensor.
    """
    if (again is None or not torch.is_grad_enabled() or x.numel() == 0 or not x.is_contiguous()
            or x.storage_offset() or x.untyped_storage().nbytes() != x.numel() * x.element_size()):
        return nullcontext()
    hooks = _RebuiltSaves(x, again)
    return torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack)
