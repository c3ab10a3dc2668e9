"""Row-chunked recomputation: a row-wise function computed block by block and recomputed block by block in
the backward (the memory of ``torch.utils.checkpoint`` per block, without its RNG bookkeeping, which CUDA-graph
capture forbids). Used for the layer's per-head projections and the indexer loss's student.

The query head path (``q_b_proj`` -> per-head RMSNorm -> RoPE) and the output path (inverse RoPE -> grouped
``o_a_proj`` -> ``o_b_proj``) create several ``[T, H, d]`` temporaries, some in fp32, that plain autograd
keeps until the backward: about 0.4 MiB per row at H = 64, d = 512. Here the forward runs without saving
any of them, and the backward recomputes each block of rows and back-propagates through it, so only the
small inputs stay alive (``qr`` for the query path; ``o``, which sparse attention keeps anyway, for the
output path) and the temporaries never exceed one block of rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["row_chunked", "NoCtx"]


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
