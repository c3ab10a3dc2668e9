"""The per-head core of the layer, one block of rows at a time: query heads -> sparse attention -> output.

Why: at H = 64, d = 512 every per-head tensor is 64 KiB per row in bf16. Plain autograd around the fused
kernels keeps ``q`` and ``o`` for the backward and then creates ``do`` and ``dq`` next to them: four
``[T, H, d]`` tensors, 8 GiB at 32k tokens, plus the fp32 temporaries of the per-head RMSNorm and RoPE.
Here nothing of that size is kept:

* forward, per block of rows: ``q = heads(qr)``, ``(o, lse) = attn(q, keys, ids)``, ``y = out(o)``; only the
  small inputs are saved (``qr [T, q_lora]``, the keys, the weights). An optional hook sees each block's
  ``q`` and ``lse`` (the indexer loss takes its teacher from them);
* backward, per block: recompute ``q`` (autograd only for the per-head norm and RoPE), recompute ``(o, lse)``
  with the attention forward, back-propagate the output projection to get ``do`` (recomputing only
  ``o_b_proj``'s input, not the block's output), run the attention backward (key gradients summed over blocks
  in one fp32 buffer), then back-propagate ``q``'s projection. The three projections are differentiated by
  hand: each weight gradient is added into its fp32 sum by the GEMM that computes it.

The price is one more attention forward per step (about 1/4.5 of the attention's forward + backward) on top
of the projections, which were already recomputed. The block index lists are made per block (``BlockIds``:
a function of saved index tensors), so the HCA range expansion and the CSA window + top-k concatenation never
exist for all rows at once either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops.backend import Backend
from ..ops.recompute import NoCtx
from ..ops.rope import apply_rope
from ..ops.sparse_attn import SparseAttnConfig, sparse_attn_chunk, sparse_attn_ref
from .modules import grouped_linear, rms_norm_unweighted

__all__ = ["BlockIds", "CoreGeometry", "attention_core", "query_heads", "grouped_output", "output_projection"]


class BlockIds(NamedTuple):
    """Rows ``lo..hi``'s ``[hi - lo, K]`` key ids (rows of ``keys``, -1 = none) as ``make(*tensors, lo, hi)``.

    The index tensors are handed over, not closed over: the core saves them for its backward like any input,
    so autograd frees them once the backward has run (or keeps them with ``retain_graph``). A closure kept on
    the autograd node would hold them (the CSA top-k and window ids, int64: 640 MiB at 128k tokens) until the
    layer's output is freed, under the rest of the backward's peak.
    """

    make: Callable[..., Tensor]
    tensors: tuple[Tensor, ...]

    def __call__(self, lo: int, hi: int) -> Tensor:
        return self.make(*self.tensors, lo, hi)
# on_block(lo, hi, q [hi - lo, H, d], lse [hi - lo, H]) runs once per block in the forward, without autograd
BlockHook = Callable[[int, int, Tensor, Tensor], None]


def query_heads(qr: Tensor, cos: Tensor, sin: Tensor, weight: Tensor, heads: int, eps: float,
                backend: Backend = "reference") -> Tensor:
    """``qr [R, q_lora]`` -> ``q [R, H, d]``: projection, per-head RMSNorm without weight, RoPE (one Triton
    pass on ``backend="triton"``)."""
    return _norm_rope_heads(F.linear(qr, weight), cos, sin, heads, eps, backend)


def _norm_rope_heads(qp: Tensor, cos: Tensor, sin: Tensor, heads: int, eps: float, backend: Backend) -> Tensor:
    """The query projection's output ``[R, H d]`` -> ``q [R, H, d]``: per-head RMSNorm, RoPE."""
    q = qp.unflatten(-1, (heads, -1))
    if backend == "triton":
        from ..ops.rope.triton import head_norm_rope_triton  # lazy: importing csattn must not need Triton

        return head_norm_rope_triton(q, cos, sin, eps)
    return apply_rope(rms_norm_unweighted(q, eps), cos, sin)


def grouped_output(o: Tensor, cos: Tensor, sin: Tensor, w_a: Tensor, groups: int, backend: Backend = "reference",
                   consume: bool = False) -> Tensor:
    """``o [R, H, d]`` -> ``[R, G o_lora]``: inverse RoPE (one Triton pass on ``backend="triton"``), grouped
    ``o_a_proj``.
    ``consume``: ``o`` is not read again, so the fused path rotates it in place (outside autograd)."""
    return grouped_linear(_unrope_groups(o, cos, sin, groups, backend, consume), w_a, groups)


def _unrope_groups(o: Tensor, cos: Tensor, sin: Tensor, groups: int, backend: Backend, consume: bool = False) -> Tensor:
    """``o [R, H, d]`` -> ``[R, G, H d / G]``: inverse RoPE, the heads grouped for ``o_a_proj``."""
    if backend == "triton":
        from ..ops.rope.triton import rope_heads_triton, rope_heads_triton_

        o = rope_heads_triton_(o, cos, sin, inverse=True) if consume else rope_heads_triton(o, cos, sin, inverse=True)
    else:
        o = apply_rope(o, cos, sin, inverse=True)
    return o.reshape(o.shape[0], groups, -1)


def _unrope_grad(du: Tensor, cos: Tensor, sin: Tensor, heads: int, backend: Backend) -> Tensor:
    """The attention output's gradient from that of its inverse rotation, ``du [R, G, H d / G]`` -> ``[R, H, d]``:
    a rotation's transpose is the opposite rotation. The fused path rotates the fresh ``du`` in place."""
    g = du.view(du.shape[0], heads, -1)
    if backend == "triton":
        from ..ops.rope.triton import rope_heads_triton_

        return rope_heads_triton_(g, cos, sin)
    return apply_rope(g, cos, sin)


def _add_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` (batched for 3-d operands) in ``acc``'s dtype, one GEMM: on CUDA the bf16 product is not
    rounded to bf16 and then added by another kernel, it accumulates in the GEMM's fp32 epilogue."""
    batched = a.dim() == 3
    if a.dtype == acc.dtype:
        (acc.baddbmm_ if batched else acc.addmm_)(a, b)
    elif acc.is_cuda:
        (torch.baddbmm if batched else torch.addmm)(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:  # the CPU has no mixed-dtype GEMM
        (acc.baddbmm_ if batched else acc.addmm_)(a.to(acc.dtype), b.to(acc.dtype))


def output_projection(o: Tensor, cos: Tensor, sin: Tensor, w_a: Tensor, w_b: Tensor, groups: int,
                      backend: Backend = "reference", consume: bool = False) -> Tensor:
    """``o [R, H, d]`` -> ``[R, D]``: inverse RoPE, grouped ``o_a_proj``, then ``o_b_proj`` (``consume``: see
    :func:`grouped_output`)."""
    return F.linear(grouped_output(o, cos, sin, w_a, groups, backend, consume), w_b)


@dataclass(frozen=True)
class CoreGeometry:
    """Static settings of :func:`attention_core`."""

    heads: int
    groups: int
    eps: float
    scale: float
    block_rows: int
    backend: Backend  # resolved: "triton" or "reference"
    ref_chunk_rows: int = 1024  # row chunks of the reference attention inside one block
    # launch settings of the fused attention (None: the defaults); kept on the autograd node with the rest of the
    # geometry, so the backward's recomputed forward and its attention backward launch as the forward did
    sparse_attn: SparseAttnConfig | None = None


def _attn_forward(q: Tensor, keys: Tensor, ids: Tensor, sinks: Tensor, geo: CoreGeometry) -> tuple[Tensor, Tensor]:
    if geo.backend == "triton":
        from ..ops.sparse_attn.triton import sparse_attn_fwd  # lazy: importing csattn must not need Triton

        return sparse_attn_fwd(q, keys, ids, sinks, geo.scale, config=geo.sparse_attn)
    return sparse_attn_ref(q, keys, ids, sinks, geo.scale, chunk_rows=geo.ref_chunk_rows)


def _keys_in_stored_order(q: Tensor, keys: Tensor, geo: CoreGeometry) -> bool:
    """Whether the fused attention backward sums the key gradient in its own column order (the Gluon kernel), so
    that ``dkeys`` is kept in that order over the blocks and put in order once (a pass per block otherwise)."""
    if geo.backend != "triton":
        return False
    from ..ops.sparse_attn.triton import dkv_in_stored_order

    return dkv_in_stored_order(q, keys, geo.sparse_attn)


def _attn_backward(q: Tensor, keys: Tensor, ids: Tensor, sinks: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                   dkeys: Tensor, stored: bool, geo: CoreGeometry) -> tuple[Tensor, Tensor]:
    """``(dq, dsink)`` of one block; the key gradient is added into ``dkeys`` (fp32 or fp64; in the kernel's
    stored column order where ``stored``, see :func:`_keys_in_stored_order`)."""
    if geo.backend == "triton":
        from ..ops.sparse_attn.triton import sparse_attn_bwd

        dq, _, dsink = sparse_attn_bwd(q, keys, ids, sinks, geo.scale, o, lse, do, config=geo.sparse_attn,
                                       dkv_accum=dkeys, dkv_accum_stored=stored)
        return dq, dsink
    # Reference: differentiate one row chunk at a time (no torch.utils.checkpoint: its RNG bookkeeping is not
    # allowed under CUDA graph capture, and the chunk is recomputed here anyway).
    dq = torch.empty_like(q)
    dsink = torch.zeros_like(sinks)
    keys_ = keys.detach().requires_grad_()
    sinks_ = sinks.detach().requires_grad_()
    for lo in range(0, q.shape[0], geo.ref_chunk_rows):
        hi = min(lo + geo.ref_chunk_rows, q.shape[0])
        with torch.enable_grad():
            q_ = q[lo:hi].detach().requires_grad_()
            o_, _ = sparse_attn_chunk(q_, keys_, ids[lo:hi], sinks_, geo.scale)
            g_q, g_k, g_s = torch.autograd.grad(o_, (q_, keys_, sinks_), do[lo:hi])
        dq[lo:hi] = g_q
        dkeys += g_k
        dsink += g_s
    return dq, dsink


class _AttentionCore(torch.autograd.Function):
    @staticmethod
    def forward(ctx, geo: CoreGeometry, ids_fn: BlockIds, on_block: BlockHook | None, qr: Tensor, cos: Tensor,
                sin: Tensor, keys: Tensor, sinks: Tensor, w_q: Tensor, w_oa: Tensor, w_ob: Tensor) -> Tensor:
        ctx.geo, ctx.make_ids = geo, ids_fn.make
        ctx.save_for_backward(qr, cos, sin, keys, sinks, w_q, w_oa, w_ob, *ids_fn.tensors)
        total = qr.shape[0]
        out = qr.new_empty(total, w_ob.shape[0])
        for lo in range(0, total, geo.block_rows):
            hi = min(lo + geo.block_rows, total)
            q = query_heads(qr[lo:hi], cos[lo:hi], sin[lo:hi], w_q, geo.heads, geo.eps, geo.backend)
            o, lse = _attn_forward(q, keys, ids_fn(lo, hi), sinks, geo)
            if on_block is not None:
                on_block(lo, hi, q, lse)
            out[lo:hi] = output_projection(o, cos[lo:hi], sin[lo:hi], w_oa, w_ob, geo.groups, geo.backend,
                                           consume=True)
        return out

    @staticmethod
    def backward(ctx, dy: Tensor):
        qr, cos, sin, keys, sinks, w_q, w_oa, w_ob, *id_tensors = ctx.saved_tensors
        ids_fn = BlockIds(ctx.make_ids, tuple(id_tensors))
        geo = ctx.geo
        acc = torch.promote_types(keys.dtype, torch.float32)
        dqr = torch.empty_like(qr)
        dkeys = torch.zeros(keys.shape, dtype=acc, device=keys.device)
        dsinks = torch.zeros(sinks.shape, dtype=acc, device=sinks.device)
        dw = [torch.zeros(w.shape, dtype=acc, device=w.device) for w in (w_q, w_oa, w_ob)]
        total = qr.shape[0]
        w_q, w_oa, w_ob = w_q.detach(), w_oa.detach(), w_ob.detach()
        w_g = w_oa.view(geo.groups, -1, w_oa.shape[-1])  # [G, o_lora, i]
        stored = None  # whether dkeys is in the attention kernel's column order: the same answer for every block
        for lo in range(0, total, geo.block_rows):
            hi = min(lo + geo.block_rows, total)
            ids = ids_fn(lo, hi)
            c, s = cos[lo:hi], sin[lo:hi]
            # The three projections by hand around autograd for the elementwise parts: each weight gradient goes
            # into its fp32 sum in one GEMM per block (no bf16 block gradient rounded, copied and added), and
            # o_b_proj's input is all its backward needs, so the block's output is not recomputed.
            qr_b = qr[lo:hi].detach()
            qp = F.linear(qr_b, w_q)
            with torch.enable_grad():
                qp.requires_grad_()
                q = _norm_rope_heads(qp, c, s, geo.heads, geo.eps, geo.backend)
            q_d = q.detach().contiguous()
            o, lse = _attn_forward(q_d, keys, ids, sinks, geo)
            dy_b = dy[lo:hi]
            u = _unrope_groups(o, c, s, geo.groups, geo.backend)  # [R, G, i]; o stays for the backward
            z = grouped_linear(u, w_oa, geo.groups)  # [R, G o_lora] (no autograd here)
            u_g = u.transpose(0, 1)  # [G, R, i], a view: the GEMMs take the strides as they are
            _add_product(dw[2], dy_b.t(), z)
            del z
            dz = (dy_b @ w_ob).unflatten(1, (geo.groups, -1)).transpose(0, 1)  # [G, R, o_lora]
            _add_product(dw[1].view_as(w_g), dz.transpose(1, 2), u_g)
            du = torch.empty_like(u)  # [R, G, i], written group by group through its [G, R, i] view
            torch.bmm(dz, w_g, out=du.transpose(0, 1))
            del u, u_g, dz
            do = _unrope_grad(du, c, s, geo.heads, geo.backend)
            del du
            if stored is None:
                stored = _keys_in_stored_order(q_d, keys, geo)
            dq, dsink = _attn_backward(q_d, keys, ids, sinks, o, lse, do, dkeys, stored, geo)
            del do, o
            (dqp,) = torch.autograd.grad(q, qp, dq)
            dqr[lo:hi] = dqp @ w_q
            _add_product(dw[0], dqp.t(), qr_b)
            dsinks += dsink
        if stored:
            from ..ops.sparse_attn.triton import dkv_columns

            dkeys_out = torch.empty_like(keys)
            dkv_columns(dkeys, dkeys_out, accumulate=False)
        else:
            dkeys_out = dkeys.to(keys.dtype)
        grads = (dqr, None, None, dkeys_out, dsinks.to(sinks.dtype),
                 *(g.to(w.dtype) for g, w in zip(dw, (w_q, w_oa, w_ob))))
        return (None, None, None, *grads)


def attention_core(
    qr: Tensor,
    cos: Tensor,
    sin: Tensor,
    keys: Tensor,
    sinks: Tensor,
    w_q: Tensor,
    w_oa: Tensor,
    w_ob: Tensor,
    ids_fn: BlockIds,
    geo: CoreGeometry,
    on_block: BlockHook | None = None,
) -> Tensor:
    """``out_proj(attn(query_heads(qr), keys, ids))`` block by block, recomputed block by block in the backward.

    Args:
        qr: ``[T, q_lora]`` normalized query latent. cos, sin: ``[T, rope/2]`` RoPE tables of the rows.
        keys: ``[N, d]`` the shared K = V rows (raw window rows, then compressed entries).
        sinks: ``[H]`` attention sink logits. w_q: ``q_b_proj.weight [H d, q_lora]``; w_oa: ``o_a_proj.weight
            [G o_lora, H d / G]`` (block-diagonal, one block per group); w_ob: ``o_b_proj.weight [D, G o_lora]``.
        ids_fn: a :class:`BlockIds`; ``ids_fn(lo, hi)`` gives rows ``lo..hi``'s ``[hi - lo, K]`` key ids (-1 =
            none); called once per block in the forward and again in the backward, its tensors saved for it.
        geo: heads, groups, eps, scale, rows per block, backend and the fused attention's launch settings.
        on_block: optional forward hook ``(lo, hi, q, lse)`` per block (no autograd).

    Returns:
        ``[T, D]``. Gradients flow to ``qr``, ``keys``, ``sinks`` and the three weights.
    """
    keys = keys.contiguous()
    if not torch.is_grad_enabled() or not any(
        t.requires_grad for t in (qr, keys, sinks, w_q, w_oa, w_ob)
    ):
        with torch.no_grad():
            return _AttentionCore.forward(NoCtx(), geo, ids_fn, on_block, qr, cos, sin, keys, sinks, w_q, w_oa,
                                          w_ob)
    return _AttentionCore.apply(geo, ids_fn, on_block, qr, cos, sin, keys, sinks, w_q, w_oa, w_ob)
