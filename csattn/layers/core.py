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
  hand: each weight gradient is added into its fp32 sum by the GEMM that computes it, and only where asked for.
  A projection's low-rank term (LoRA's pair, :class:`~csattn.layers.modules.Projection`) runs factored: a
  frozen weight with LoRA costs its rank-``r`` products, not a gradient GEMM of its own size (at V4-Flash's
  widths the three weight gradients are ~3.3 TFLOP a layer at 16k tokens).

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
from .modules import (
    LowRankTerm,
    Projection,
    grouped_augmented,
    grouped_linear,
    grouped_product,
    linear,
    rms_norm_unweighted,
)

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


def query_heads(qr: Tensor, cos: Tensor, sin: Tensor, q_b: Projection, heads: int, eps: float,
                backend: Backend = "reference") -> Tensor:
    """``qr [R, q_lora]`` -> ``q [R, H, d]``: projection ``q_b`` (with its low-rank term), per-head RMSNorm without
    weight, RoPE (one Triton pass on ``backend="triton"``)."""
    return _norm_rope_heads(linear(qr, q_b), cos, sin, heads, eps, backend)


def _norm_rope_heads(qp: Tensor, cos: Tensor, sin: Tensor, heads: int, eps: float, backend: Backend) -> Tensor:
    """The query projection's output ``[R, H d]`` -> ``q [R, H, d]``: per-head RMSNorm, RoPE."""
    q = qp.unflatten(-1, (heads, -1))
    if backend == "triton":
        from ..ops.rope.triton import head_norm_rope_triton  # lazy: importing csattn must not need Triton

        return head_norm_rope_triton(q, cos, sin, eps)
    return apply_rope(rms_norm_unweighted(q, eps), cos, sin)


def grouped_output(o: Tensor, cos: Tensor, sin: Tensor, o_a: Projection, groups: int, backend: Backend = "reference",
                   consume: bool = False) -> Tensor:
    """``o [R, H, d]`` -> ``[R, G o_lora]``: inverse RoPE (one Triton pass on ``backend="triton"``), grouped
    ``o_a_proj`` (with its low-rank term).
    ``consume``: ``o`` is not read again, so the fused path rotates it in place (outside autograd)."""
    return grouped_linear(_unrope_groups(o, cos, sin, groups, backend, consume), o_a.weight, groups, o_a.term)


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


def output_projection(o: Tensor, cos: Tensor, sin: Tensor, o_a: Projection, o_b: Projection, groups: int,
                      backend: Backend = "reference", consume: bool = False) -> Tensor:
    """``o [R, H, d]`` -> ``[R, D]``: inverse RoPE, grouped ``o_a_proj``, then ``o_b_proj`` (each with its
    low-rank term; ``consume``: see :func:`grouped_output`)."""
    return linear(grouped_output(o, cos, sin, o_a, groups, backend, consume), o_b)


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
    def forward(ctx, geo: CoreGeometry, ids_fn: BlockIds, on_block: BlockHook | None, scales: tuple[float, ...],
                qr: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, sinks: Tensor, w_q: Tensor, w_oa: Tensor,
                w_ob: Tensor, *terms: Tensor | None) -> Tensor:
        # terms: (a, b) of q_b, o_a, o_b (None where a projection has no low-rank term); scales: their scales
        ctx.geo, ctx.make_ids, ctx.scales = geo, ids_fn.make, scales
        ctx.save_for_backward(qr, cos, sin, keys, sinks, w_q, w_oa, w_ob, *terms, *ids_fn.tensors)
        q_b, o_a, o_b = _projections((w_q, w_oa, w_ob), terms, scales)
        wq, wa = _augmented(q_b), _grouped_augmented(o_a, geo.groups)
        total = qr.shape[0]
        out = qr.new_empty(total, w_ob.shape[0])
        for lo in range(0, total, geo.block_rows):
            hi = min(lo + geo.block_rows, total)
            q = _norm_rope_heads(_product(qr[lo:hi], q_b, wq), cos[lo:hi], sin[lo:hi], geo.heads, geo.eps,
                                 geo.backend)
            o, lse = _attn_forward(q, keys, ids_fn(lo, hi), sinks, geo)
            if on_block is not None:
                on_block(lo, hi, q, lse)
            u = _unrope_groups(o, cos[lo:hi], sin[lo:hi], geo.groups, geo.backend, consume=True)
            out[lo:hi] = linear(_grouped_product(u, o_a, wa)[0], o_b)
        return out

    @staticmethod
    def backward(ctx, dy: Tensor):
        qr, cos, sin, keys, sinks, w_q, w_oa, w_ob, *rest = ctx.saved_tensors
        terms, id_tensors = rest[:6], rest[6:]
        ids_fn = BlockIds(ctx.make_ids, tuple(id_tensors))
        geo = ctx.geo
        acc = torch.promote_types(keys.dtype, torch.float32)
        dqr = torch.empty_like(qr)
        dkeys = torch.zeros(keys.shape, dtype=acc, device=keys.device)
        dsinks = torch.zeros(sinks.shape, dtype=acc, device=sinks.device)
        # each weight's and factor's gradient summed in fp32 over the blocks, only where one is asked for: a frozen
        # weight costs no gradient GEMM of its size (its low-rank term's are rank-r products)
        need = ctx.needs_input_grad[9:18]
        sums = [torch.zeros(t.shape, dtype=acc, device=t.device) if n else None
                for t, n in zip((w_q, w_oa, w_ob, *terms), need)]
        dw_q, dw_oa, dw_ob, *dterms = sums  # dterms: (da, db) of q_b, o_a, o_b
        q_b, o_a, o_b = _projections((w_q.detach(), w_oa.detach(), w_ob.detach()),
                                     [None if t is None else t.detach() for t in terms], ctx.scales)
        wq, wa = _augmented(q_b), _grouped_augmented(o_a, geo.groups)
        total = qr.shape[0]
        w_g = o_a.weight.view(geo.groups, -1, w_oa.shape[-1])  # [G, o_lora, i]
        stored = None  # whether dkeys is in the attention kernel's column order: the same answer for every block
        for lo in range(0, total, geo.block_rows):
            hi = min(lo + geo.block_rows, total)
            ids = ids_fn(lo, hi)
            c, s = cos[lo:hi], sin[lo:hi]
            # The three projections by hand around autograd for the elementwise parts: each gradient goes into its
            # fp32 sum in one GEMM per block (no bf16 block gradient rounded, copied and added), and o_b_proj's
            # input is all its backward needs, so the block's output is not recomputed.
            qr_b = qr[lo:hi].detach()
            qp = _product(qr_b, q_b, wq)
            with torch.enable_grad():
                qp.requires_grad_()
                q = _norm_rope_heads(qp, c, s, geo.heads, geo.eps, geo.backend)
            q_d = q.detach().contiguous()
            o, lse = _attn_forward(q_d, keys, ids, sinks, geo)
            u = _unrope_groups(o, c, s, geo.groups, geo.backend)  # [R, G, i]; o stays for the backward
            # z [R, G o_lora] (no autograd here) and, with a term, u a^T [R, G, r] from the same pass over u
            z, ua = _grouped_product(u, o_a, wa)
            dz = _linear_backward(dy[lo:hi], z, o_b, dw_ob, dterms[4:6])  # [R, G o_lora]
            del z
            du = _grouped_backward(dz.unflatten(1, (geo.groups, -1)).transpose(0, 1), u, ua, w_g, wa, o_a.term,
                                   dw_oa, dterms[2:4])
            del u, ua, dz
            do = _unrope_grad(du, c, s, geo.heads, geo.backend)
            del du
            if stored is None:
                stored = _keys_in_stored_order(q_d, keys, geo)
            dq, dsink = _attn_backward(q_d, keys, ids, sinks, o, lse, do, dkeys, stored, geo)
            del do, o
            (dqp,) = torch.autograd.grad(q, qp, dq)
            dqr[lo:hi] = _linear_backward(dqp, qr_b, q_b, dw_q, dterms[0:2], wq)
            dsinks += dsink
        if stored:
            from ..ops.sparse_attn.triton import dkv_columns

            dkeys_out = torch.empty_like(keys)
            dkv_columns(dkeys, dkeys_out, accumulate=False)
        else:
            dkeys_out = dkeys.to(keys.dtype)
        scales = [1.0, 1.0, 1.0, *(sc for sc in ctx.scales for _ in range(2))]  # a term's factors: times its scale
        grads = [None if g is None else (g * sc).to(t.dtype)
                 for g, t, sc in zip(sums, (w_q, w_oa, w_ob, *terms), scales)]
        return (None, None, None, None, dqr, None, None, dkeys_out, dsinks.to(sinks.dtype), *grads)


def _projections(weights: tuple[Tensor, Tensor, Tensor], terms, scales) -> tuple[Projection, ...]:
    """``q_b``, ``o_a``, ``o_b`` from the weights, the terms' flat factors ``(a, b) x 3`` (None: no term) and their
    scales."""
    return tuple(Projection.of((w, *terms[2 * i:2 * i + 2]), scales[i]) for i, w in enumerate(weights))


def _augmented(p: Projection) -> Tensor | None:
    """``[W | b]`` (``[out, in + r]``) for :func:`_product`, or None without a term. Made once a forward (and once
    a backward): a copy of ``W``, against a pass over every block's output."""
    return None if p.term is None else torch.cat([p.weight, p.term.b.to(p.weight.dtype)], 1)


def _product(x: Tensor, p: Projection, w_aug: Tensor | None) -> Tensor:
    """``x W^T + scale (x a^T) b^T`` without autograd, one GEMM of depth ``in + r`` over ``[x | scale x a^T]`` and
    ``w_aug`` = ``[W | b]`` (:func:`_augmented`): the term is not added by another pass over the output, which is
    wide here (``q_b_proj``: ``H d`` = 32768 columns at V4's widths, 32 times its input)."""
    if w_aug is None:
        return F.linear(x, p.weight)
    a, _, scale = p.term
    return F.linear(torch.cat([x, F.linear(x, a) * scale], -1), w_aug)


def _grouped_augmented(p: Projection, groups: int) -> Tensor | None:
    return None if p.term is None else grouped_augmented(p.weight, groups, p.term)


def _grouped_product(u: Tensor, p: Projection, w_aug: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``(z, u a^T)`` of ``o_a_proj`` on ``u [R, G, i]`` without autograd (:func:`~.modules.grouped_product`;
    ``u a^T`` None without a term)."""
    if w_aug is None:
        return grouped_linear(u, p.weight, u.shape[1]), None
    return grouped_product(u, p.weight, p.term, w_aug)


def _linear_backward(dy: Tensor, x: Tensor, p: Projection, dw: Tensor | None, dab: list,
                     w_aug: Tensor | None = None) -> Tensor:
    """``dx`` of ``y = x W^T + scale (x a^T) b^T`` (``x [R, in]``, ``dy [R, out]``); adds ``dy^T x`` into ``dw`` and
    ``(dy b)^T x``, ``dy^T (x a^T)`` into ``dab = [da, db]`` (fp32 sums, the scale applied once at the end; None:
    not asked for). With ``w_aug`` (:func:`_augmented`) ``dy W`` and ``dy b`` come from one pass over ``dy``."""
    if w_aug is None:
        dx = dy @ p.weight
    else:
        both = dy @ w_aug  # [R, in + r]
        dx, dyb = both[:, :x.shape[1]], both[:, x.shape[1]:]
    if dw is not None:
        _add_product(dw, dy.t(), x)
    if p.term is not None:
        a, b, scale = p.term
        if w_aug is None:
            dyb = dy @ b  # [R, r]
        if dab[0] is not None:
            _add_product(dab[0], dyb.t(), x)
        if dab[1] is not None:
            _add_product(dab[1], dy.t(), F.linear(x, a))
        dx = torch.addmm(dx, dyb, a, alpha=scale)
    return dx


def _grouped_backward(dz: Tensor, u: Tensor, ua: Tensor | None, w_g: Tensor, w_aug: Tensor | None,
                      term: LowRankTerm | None, dw: Tensor | None, dab: list) -> Tensor:
    """``du [R, G, i]`` of the grouped ``z_g = u_g W_g^T + scale (u_g a^T) b_g^T`` from ``dz [G, R, o]`` (a view);
    ``u [R, G, i]``, ``ua = u a^T [R, G, r]`` and ``w_aug`` = ``[W_g ; a]`` (with a term), ``w_g [G, o, i]``; sums as
    :func:`_linear_backward` (``dw`` ``[G o, i]``). With a term ``du_g = [dz_g | scale dz_g b_g] [W_g ; a]`` in one
    batched GEMM (no second pass over ``du``, which is ``H d`` wide)."""
    groups, rows = w_g.shape[0], u.shape[0]
    u_g = u.transpose(0, 1)  # [G, R, i], a view: the GEMMs take the strides as they are
    if dw is not None:
        _add_product(dw.view_as(w_g), dz.transpose(1, 2), u_g)
    du = torch.empty_like(u)  # [R, G, i], written group by group through its [G, R, i] view
    if term is None:
        torch.bmm(dz, w_g, out=du.transpose(0, 1))
        return du
    a, b, scale = term
    b_g = b.view(groups, -1, b.shape[-1])  # [G, o, r]
    dzb = torch.bmm(dz, b_g)  # [G, R, r]
    if dab[0] is not None:  # da = sum over the groups of (dz_g b_g)^T u_g, in u's row order
        _add_product(dab[0], dzb.transpose(0, 1).reshape(rows * groups, -1).t(), u.view(rows * groups, -1))
    if dab[1] is not None:
        _add_product(dab[1].view_as(b_g), dz.transpose(1, 2), ua.transpose(0, 1))
    torch.bmm(torch.cat([dz, dzb * scale], 2), w_aug, out=du.transpose(0, 1))
    return du


def attention_core(
    qr: Tensor,
    cos: Tensor,
    sin: Tensor,
    keys: Tensor,
    sinks: Tensor,
    q_b: Projection,
    o_a: Projection,
    o_b: Projection,
    ids_fn: BlockIds,
    geo: CoreGeometry,
    on_block: BlockHook | None = None,
) -> Tensor:
    """``out_proj(attn(query_heads(qr), keys, ids))`` block by block, recomputed block by block in the backward.

    Args:
        qr: ``[T, q_lora]`` normalized query latent. cos, sin: ``[T, rope/2]`` RoPE tables of the rows.
        keys: ``[N, d]`` the shared K = V rows (raw window rows, then compressed entries).
        sinks: ``[H]`` attention sink logits.
        q_b, o_a, o_b: the projections (:class:`~csattn.layers.modules.Projection`: weight and optional low-rank
            term): ``q_b_proj [H d, q_lora]``; ``o_a_proj [G o_lora, H d / G]`` (block-diagonal, one block per
            group; its term's ``a`` shared by the groups); ``o_b_proj [D, G o_lora]``.
        ids_fn: a :class:`BlockIds`; ``ids_fn(lo, hi)`` gives rows ``lo..hi``'s ``[hi - lo, K]`` key ids (-1 =
            none); called once per block in the forward and again in the backward, its tensors saved for it.
        geo: heads, groups, eps, scale, rows per block, backend and the fused attention's launch settings.
        on_block: optional forward hook ``(lo, hi, q, lse)`` per block (no autograd).

    Returns:
        ``[T, D]``. Gradients flow to ``qr``, ``keys``, ``sinks``, the weights that require them and the terms'
        factors (the terms run factored: a frozen weight gets no gradient GEMM).
    """
    keys = keys.contiguous()
    projections = (q_b, o_a, o_b)
    terms = tuple(t for p in projections for t in (p.term[:2] if p.term else (None, None)))
    scales = tuple(p.scale for p in projections)
    args = (qr, cos, sin, keys, sinks, q_b.weight, o_a.weight, o_b.weight, *terms)
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in args):
        with torch.no_grad():
            return _AttentionCore.forward(NoCtx(), geo, ids_fn, on_block, scales, *args)
    return _AttentionCore.apply(geo, ids_fn, on_block, scales, *args)
