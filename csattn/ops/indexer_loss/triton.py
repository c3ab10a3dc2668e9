"""Fused indexer KL loss (sparse over the selected ids, or dense over each row's visible range), Triton.

One program per query row walks its candidates in tiles of ``BK`` keys and never holds more than one tile:

- student: ``s_i = sum_h w_h relu(q_idx_h . k_i)`` from one ``tl.dot`` ``[BK, cI] x [cI, HI]``;
- teacher: ``m_i = sum_h exp(scale * q_h . ckv_i - lse_h)`` from ``[BK, d] x [d, H]`` in ``BD``-wide slices;
- running sums ``M = sum m``, ``A = sum m log m``, ``B = sum m s`` and an online log-sum-exp of ``s``, so
  ``KL = A/M - log M - B/M + lse(s)`` (with ``T = m / M``: ``sum T log T - sum T s + lse(s)``).

Backward (per row again): ``dL/ds_i = g (softmax(s)_i - T_i)`` with ``g = grad * row_weight``; then
``dw_h = sum_i ds_i relu(L_ih)``, ``G = ds w (L > 0)``, ``dq_idx = G^T K``, ``dk_i += G_i q_idx`` (atomic adds:
several rows pick the same key). The sparse forward keeps the teacher masses ``[T, k]`` (fp32, the size of the
index list) so the backward does not recompute the d-wide teacher; the dense backward recomputes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..autograd import named_grads
from ..fixed_point import abs_max, fixed_point_scale, from_fixed_point
from .config import IndexerLossConfig

__all__ = ["IndexerLossConfig", "indexer_kl_loss_triton", "indexer_kl_fwd", "indexer_kl_bwd",
           "sparse_teacher_block_triton", "indexer_kl_from_teacher_triton"]

_DEFAULT = IndexerLossConfig()


@triton.jit
def _student_tile(q_idx_t, w_t, k_idx, ids_c, valid, CI: tl.constexpr, CIP: tl.constexpr, IEEE: tl.constexpr):
    """Keys ``[BK, cI]``, per-head logits ``L [BK, HIP]`` and scores ``s [BK]`` of one candidate tile."""
    ch = tl.arange(0, CIP)
    keys = tl.load(k_idx + ids_c[:, None] * CI + ch[None, :], mask=valid[:, None] & (ch[None, :] < CI), other=0.0)
    if IEEE:
        logits = tl.dot(keys, q_idx_t, input_precision="ieee")
    else:
        logits = tl.dot(keys, q_idx_t)
    scores = tl.sum(tl.maximum(logits, 0.0) * w_t[None, :], axis=1)
    return keys, logits, scores


@triton.jit
def _teacher_tile(q_t, ckv, lse_t, ids_c, valid, scale, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                  BD: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """``m_i = sum_h exp(scale * q_h . ckv_i - lse_h)`` for one candidate tile, ``[BK]`` fp32 (0 where invalid)."""
    heads = tl.arange(0, HP)
    acc = tl.zeros((BK, HP), dtype=tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        cv = tl.load(ckv + ids_c[:, None] * D + dd[None, :], mask=valid[:, None] & (dd[None, :] < D), other=0.0)
        qt = tl.load(q_t + heads[None, :] * D + dd[:, None], mask=(heads[None, :] < H) & (dd[:, None] < D),
                     other=0.0)
        if IEEE:
            acc += tl.dot(cv, qt, input_precision="ieee")
        else:
            acc += tl.dot(cv, qt)
    p = tl.exp(acc * scale - lse_t[None, :])
    p = tl.where((heads[None, :] < H) & valid[:, None], p, 0.0)
    return tl.sum(p, axis=1)


@triton.jit
def indexer_kl_fwd_kernel(
    q_idx, w, k_idx, q, ckv, lse, selected, vis_start, vis_end, row_weight,
    loss_rows, stats, mass, scale, topk,
    HI: tl.constexpr, HIP: tl.constexpr, CI: tl.constexpr, CIP: tl.constexpr,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
    BK: tl.constexpr, BD: tl.constexpr, DENSE: tl.constexpr, STORE_MASS: tl.constexpr, IEEE: tl.constexpr,
    TIEEE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    rw = tl.load(row_weight + t)
    if DENSE:
        start = tl.load(vis_start + t)
        n = tl.maximum(tl.load(vis_end + t) - start, 0)
    else:
        start = 0
        n = topk
    heads_i = tl.arange(0, HIP)
    ch = tl.arange(0, CIP)
    q_idx_t = tl.load(q_idx + t * HI * CI + heads_i[None, :] * CI + ch[:, None],
                      mask=(heads_i[None, :] < HI) & (ch[:, None] < CI), other=0.0)  # [CIP, HIP]
    w_t = tl.load(w + t * HI + heads_i, mask=heads_i < HI, other=0.0)
    heads = tl.arange(0, HP)
    lse_t = tl.load(lse + t * H + heads, mask=heads < H, other=0.0)
    zero = tl.zeros((), dtype=tl.float32)
    m_s = zero - float("inf")
    l_s = zero
    total = zero
    a_sum = zero
    b_sum = zero
    if rw != 0:
        for j in range(0, n, BK):
            offs = j + tl.arange(0, BK)
            if DENSE:
                ids = start + offs
                valid = offs < n
            else:
                ids = tl.load(selected + t * topk + offs, mask=offs < topk, other=-1)
                valid = ids >= 0
            ids_c = tl.where(valid, ids, 0).to(tl.int64)
            _, _, s = _student_tile(q_idx_t, w_t, k_idx, ids_c, valid, CI, CIP, IEEE)
            m = _teacher_tile(q + t * H * D, ckv, lse_t, ids_c, valid, scale, H, HP, D, BD, BK, TIEEE)
            if STORE_MASS:
                tl.store(mass + t * topk + offs, m, mask=offs < topk)
            total += tl.sum(m, axis=0)
            a_sum += tl.sum(tl.where(m > 0, m * tl.log(tl.where(m > 0, m, 1.0)), 0.0), axis=0)
            b_sum += tl.sum(tl.where(valid, m * s, 0.0), axis=0)
            s_m = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_s, tl.max(s_m, axis=0))
            if m_new > float("-inf"):
                l_s = l_s * tl.exp(m_s - m_new) + tl.sum(tl.exp(s_m - m_new), axis=0)
                m_s = m_new
    lse_s = tl.where(l_s > 0, m_s + tl.log(tl.where(l_s > 0, l_s, 1.0)), 0.0)
    safe = tl.where(total > 0, total, 1.0)
    kl = tl.where((total > 0) & (l_s > 0), a_sum / safe - tl.log(safe) - b_sum / safe + lse_s, 0.0)
    tl.store(loss_rows + t, kl * rw)
    tl.store(stats + t * 2, lse_s)
    tl.store(stats + t * 2 + 1, total)


@triton.jit
def indexer_kl_bwd_kernel(
    q_idx, w, k_idx, q, ckv, lse, selected, vis_start, vis_end, row_weight,
    stats, mass, grad, dq_idx, dw, dk, fx, scale, topk,
    HI: tl.constexpr, HIP: tl.constexpr, CI: tl.constexpr, CIP: tl.constexpr,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
    BK: tl.constexpr, BD: tl.constexpr, DENSE: tl.constexpr, STORE_MASS: tl.constexpr, IEEE: tl.constexpr,
    TIEEE: tl.constexpr, FIXED: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.load(grad) * tl.load(row_weight + t)
    # FIXED (config.deterministic): dk is an int64 buffer of fixed-point sums, fx points at the fp32 2**e
    fx_scale = 1.0
    if FIXED:
        fx_scale = tl.load(fx)
    lse_s = tl.load(stats + t * 2)
    total = tl.load(stats + t * 2 + 1)
    if (g != 0) & (total > 0):
        if DENSE:
            start = tl.load(vis_start + t)
            n = tl.maximum(tl.load(vis_end + t) - start, 0)
        else:
            start = 0
            n = topk
        heads_i = tl.arange(0, HIP)
        ch = tl.arange(0, CIP)
        qi_mask = (heads_i[None, :] < HI) & (ch[:, None] < CI)
        q_idx_t = tl.load(q_idx + t * HI * CI + heads_i[None, :] * CI + ch[:, None], mask=qi_mask, other=0.0)
        w_t = tl.load(w + t * HI + heads_i, mask=heads_i < HI, other=0.0)
        heads = tl.arange(0, HP)
        if STORE_MASS:  # the stored masses replace the teacher: q, ckv and lse are not read
            lse_t = tl.zeros((HP,), dtype=tl.float32)
        else:
            lse_t = tl.load(lse + t * H + heads, mask=heads < H, other=0.0)
        dq_acc = tl.zeros((CIP, HIP), dtype=tl.float32)
        dw_acc = tl.zeros((HIP,), dtype=tl.float32)
        for j in range(0, n, BK):
            offs = j + tl.arange(0, BK)
            if DENSE:
                ids = start + offs
                valid = offs < n
            else:
                ids = tl.load(selected + t * topk + offs, mask=offs < topk, other=-1)
                valid = ids >= 0
            ids_c = tl.where(valid, ids, 0).to(tl.int64)
            keys, logits, s = _student_tile(q_idx_t, w_t, k_idx, ids_c, valid, CI, CIP, IEEE)
            if STORE_MASS:
                m = tl.load(mass + t * topk + offs, mask=offs < topk, other=0.0)
            else:
                m = _teacher_tile(q + t * H * D, ckv, lse_t, ids_c, valid, scale, H, HP, D, BD, BK, TIEEE)
            ds = tl.where(valid, g * (tl.exp(s - lse_s) - m / total), 0.0)  # [BK]
            dw_acc += tl.sum(ds[:, None] * tl.maximum(logits, 0.0), axis=0)
            gm = tl.where(logits > 0, ds[:, None] * w_t[None, :], 0.0).to(keys.dtype)  # [BK, HIP]
            if IEEE:
                dq_acc += tl.dot(tl.trans(keys), gm, input_precision="ieee")
                dk_t = tl.dot(gm, tl.trans(q_idx_t), input_precision="ieee")
            else:
                dq_acc += tl.dot(tl.trans(keys), gm)
                dk_t = tl.dot(gm, tl.trans(q_idx_t))
            if FIXED:  # exact int64 sums of round(x * 2**e): the same bits in any order (fixed_point.py)
                dk_t = tl.floor(dk_t * fx_scale + 0.5).to(tl.int64)
            tl.atomic_add(dk + ids_c[:, None] * CI + ch[None, :], dk_t,
                          mask=valid[:, None] & (ch[None, :] < CI), sem="relaxed")
        tl.store(dq_idx + t * HI * CI + heads_i[None, :] * CI + ch[:, None], dq_acc.to(dq_idx.dtype.element_ty),
                 mask=qi_mask)
        tl.store(dw + t * HI + heads_i, dw_acc.to(dw.dtype.element_ty), mask=heads_i < HI)


def _meta(q_idx: Tensor, q: Tensor) -> dict:
    hi, ci = q_idx.shape[1], q_idx.shape[2]
    h, d = q.shape[1], q.shape[2]
    return dict(
        HI=hi, HIP=max(16, triton.next_power_of_2(hi)), CI=ci, CIP=max(16, triton.next_power_of_2(ci)),
        H=h, HP=max(16, triton.next_power_of_2(h)), D=d, BD=min(128, max(16, triton.next_power_of_2(d))),
        IEEE=q_idx.dtype == torch.float32, TIEEE=q.dtype == torch.float32,
    )


def indexer_kl_fwd(
    q_idx: Tensor, w: Tensor, k_idx: Tensor, q: Tensor, ckv: Tensor, lse: Tensor, scale: float,
    row_weight: Tensor, selected: Tensor | None, vis_start: Tensor, vis_end: Tensor,
    out: tuple[Tensor, Tensor, Tensor] | None = None, config: IndexerLossConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per-row weighted KL ``[T]`` fp32, per-row ``(lse(s), M)`` stats ``[T, 2]`` and (sparse) masses ``[T, k]``.

    ``out``: contiguous fp32 ``(loss_rows, stats, mass)`` to write into (sparse only; ``mass`` zero-filled).
    ``config``: tiles and warps (:class:`IndexerLossConfig`; None: the defaults).
    """
    cfg = config or _DEFAULT
    num_rows = q_idx.shape[0]
    dense = selected is None
    topk = 0 if dense else selected.shape[1]
    dev = q_idx.device
    if out is not None:
        loss_rows, stats, mass = out
    else:
        loss_rows = torch.empty(num_rows, dtype=torch.float32, device=dev)
        stats = torch.empty((num_rows, 2), dtype=torch.float32, device=dev)
        mass = None if dense else torch.zeros((num_rows, topk), dtype=torch.float32, device=dev)
    dummy = loss_rows
    indexer_kl_fwd_kernel[(num_rows,)](
        q_idx, w, k_idx, q, ckv, lse, dummy if dense else selected, vis_start, vis_end, row_weight,
        loss_rows, stats, dummy if dense else mass, scale, topk,
        BK=cfg.bk_fwd, DENSE=dense, STORE_MASS=not dense, num_warps=cfg.warps_fwd, num_stages=2,
        **_meta(q_idx, q),
    )
    return loss_rows, stats, mass


def indexer_kl_bwd(
    grad: Tensor, q_idx: Tensor, w: Tensor, k_idx: Tensor, q: Tensor, ckv: Tensor, lse: Tensor, scale: float,
    row_weight: Tensor, selected: Tensor | None, vis_start: Tensor, vis_end: Tensor, stats: Tensor,
    mass: Tensor | None, dk_accum: Tensor | None = None, config: IndexerLossConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq_idx [T, HI, cI], dw [T, HI], dk_idx [Nc, cI])``: dq in ``q_idx.dtype`` and dw in
    ``w.dtype`` (each row is written by one program), dk in fp32 (rows picked by many queries add up), added
    into ``dk_accum`` when given (blocks of rows in turn). ``config``: tiles and warps (None: the defaults).
    With ``config.deterministic`` the kernel sums ``dk``
    exactly in int64 fixed point (``fixed_point.py``; an ``Nc * cI * 8`` bytes buffer of its own, turned into fp32
    / added to ``dk_accum`` once): the same bits run to run."""
    cfg = config or _DEFAULT
    num_rows = q_idx.shape[0]
    dense = selected is None
    topk = 0 if dense else selected.shape[1]
    dq = torch.zeros(q_idx.shape, dtype=q_idx.dtype, device=q_idx.device)
    dw = torch.zeros(w.shape, dtype=w.dtype, device=q_idx.device)
    dk = torch.zeros(k_idx.shape, dtype=torch.float32, device=q_idx.device) if dk_accum is None else dk_accum
    fixed = bool(cfg.deterministic) and num_rows > 0
    fx = fixed_point_scale(_dk_bound(grad, q_idx, w, row_weight)) if fixed else dk
    dk_sum = torch.zeros(k_idx.shape, dtype=torch.int64, device=q_idx.device) if fixed else dk
    dummy = stats
    indexer_kl_bwd_kernel[(num_rows,)](
        q_idx, w, k_idx, q, ckv, lse, dummy if dense else selected, vis_start, vis_end, row_weight,
        stats, dummy if dense else mass, grad, dq, dw, dk_sum, fx, scale, topk,
        BK=cfg.bk_bwd, DENSE=dense, STORE_MASS=not dense, num_warps=cfg.warps_bwd, num_stages=2, FIXED=fixed,
        **_meta(q_idx, q),
    )
    if fixed:
        from_fixed_point(dk_sum, fx, out=dk, accumulate=True)
    return dq, dw, dk


def _dk_bound(grad: Tensor, q_idx: Tensor, w: Tensor, row_weight: Tensor) -> Tensor:
    """A bound on every partial sum of ``dk`` (``fixed_point.py``), on the device: row ``t`` adds ``G_ti q_idx_t``
    with ``G_ti = sum_h ds_ti w_th [L > 0]`` and ``sum_i |ds_ti| <= 2 |g_t|`` (a difference of two
    distributions), so ``|dk| <= 2 HI max|w| max|q_idx| sum_t |g_t|``, ``g_t = grad row_weight[t]``; doubled for
    the rounding of ``G`` to the keys' dtype and of the products."""
    g_sum = grad.float().abs().reshape(()) * row_weight.float().abs().sum()
    return 4.0 * q_idx.shape[1] * abs_max(w) * abs_max(q_idx) * g_sum


class IndexerKLLossFunction(torch.autograd.Function):
    """Scalar loss; gradients to ``q_idx``, ``w``, ``k_idx`` only (the teacher and selection are constants)."""

    @staticmethod
    def forward(ctx, q_idx, w, k_idx, q, ckv, lse, scale, row_weight, selected, vis_start, vis_end, config):
        loss_rows, stats, mass = indexer_kl_fwd(q_idx, w, k_idx, q, ckv, lse, scale, row_weight, selected,
                                                vis_start, vis_end, config=config)
        ctx.config = config  # the backward launches with the forward's settings
        ctx.save_for_backward(q_idx, w, k_idx, q, ckv, lse, row_weight, selected, vis_start, vis_end, stats, mass)
        ctx.scale = scale
        return loss_rows.sum()

    @staticmethod
    def backward(ctx, grad):
        q_idx, w, k_idx, q, ckv, lse, row_weight, selected, vis_start, vis_end, stats, mass = ctx.saved_tensors
        dq, dw, dk = indexer_kl_bwd(grad.float().reshape(1).contiguous(), q_idx, w, k_idx, q, ckv, lse, ctx.scale,
                                    row_weight, selected, vis_start, vis_end, stats, mass, config=ctx.config)
        return _KLLossGrads(q_idx=dq.to(q_idx.dtype), w=dw.to(w.dtype), k_idx=dk.to(k_idx.dtype))


_KLLossGrads = named_grads(IndexerKLLossFunction)


def indexer_kl_loss_triton(
    q_idx: Tensor,
    w: Tensor,
    k_idx: Tensor,
    q: Tensor,
    ckv: Tensor,
    lse: Tensor,
    scale: float,
    row_weight: Tensor,
    selected: Tensor | None = None,
    vis_start: Tensor | None = None,
    vis_end: Tensor | None = None,
    workspace_bytes: int = 1 << 30,
    config: IndexerLossConfig | None = None,
) -> Tensor:
    """Weighted sum over rows of ``KL(teacher || softmax(indexer scores))``; contract of ``indexer_kl_loss_ref``.

    Args:
        q_idx: ``[T, HI, cI]``; w: ``[T, HI]``; k_idx: ``[Nc, cI]`` indexer queries, weights and keys.
        q: ``[T, H, d]`` attention queries; ckv: ``[Nc, d]`` compressed kv; lse: ``[T, H]`` fp32 full
            log-denominator of the attention (window + sink + compressed keys).
        scale: attention softmax scale. row_weight: ``[T]`` (``1 / num_real_rows`` for real rows, 0 else).
        selected: ``[T, k]`` int64 (-1 = none) for the sparse loss, or None for the dense loss.
        vis_start, vis_end: ``[T]`` int64 visible id ranges (needed for the dense loss).
        workspace_bytes: unused (the kernels hold one key tile per row); kept for the common signature.
        config: the kernels' launch settings (:class:`IndexerLossConfig`; None: the defaults); the backward uses
            the forward's.

    Returns:
        A fp32 scalar. Teacher inputs are detached; ``selected`` is not differentiated.

    Example:
        >>> loss = indexer_kl_loss_triton(q_idx, w, k_idx, q, ckv, lse, 512**-0.5, row_weight, selected=ids)
    """
    del workspace_bytes
    if q_idx.dim() != 3 or w.shape != q_idx.shape[:2] or k_idx.dim() != 2 or k_idx.shape[1] != q_idx.shape[2]:
        raise ValueError(f"q_idx must be [T, HI, cI], w [T, HI], k_idx [Nc, cI]; got {tuple(q_idx.shape)}, "
                         f"{tuple(w.shape)}, {tuple(k_idx.shape)}")
    if q.dim() != 3 or q.shape[0] != q_idx.shape[0] or ckv.shape != (k_idx.shape[0], q.shape[2]):
        raise ValueError(f"q must be [T, H, d] and ckv [Nc, d]; got {tuple(q.shape)}, {tuple(ckv.shape)}")
    if lse.shape != q.shape[:2]:
        raise ValueError(f"lse must be [T, H] = {tuple(q.shape[:2])}, got {tuple(lse.shape)}")
    if selected is None and (vis_start is None or vis_end is None):
        raise ValueError("the dense indexer loss needs vis_start and vis_end")
    if k_idx.shape[0] == 0 or q_idx.shape[0] == 0:
        return (q_idx.sum() + w.sum() + k_idx.sum()).float() * 0
    q_idx, w, k_idx = _student_operands(q_idx, w, k_idx)
    num_rows = q_idx.shape[0]
    dev = q_idx.device
    if vis_start is None:
        vis_start = torch.zeros(num_rows, dtype=torch.int64, device=dev)
        vis_end = vis_start
    tdtype = torch.promote_types(q.dtype, ckv.dtype)
    if tdtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q/ckv must be fp32, bf16 or fp16, got {q.dtype}, {ckv.dtype}")
    return IndexerKLLossFunction.apply(
        q_idx, w, k_idx,
        q.detach().to(tdtype).contiguous(), ckv.detach().to(tdtype).contiguous(), lse.detach().float().contiguous(),
        float(scale), row_weight.float().contiguous(),
        None if selected is None else selected.to(torch.int64).contiguous(),
        vis_start.to(torch.int64).contiguous(), vis_end.to(torch.int64).contiguous(), config or _DEFAULT,
    )


# ----------------------------------------------------------------------------------------------------------
# the sparse loss split in two: per-row forward pieces filled block by block, then the loss from them
# ----------------------------------------------------------------------------------------------------------


def _student_dtype(q_dtype: torch.dtype, k_dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels take the indexer queries and keys in."""
    dtype = torch.promote_types(q_dtype, k_dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q_idx/k_idx must be fp32, bf16 or fp16, got {q_dtype}, {k_dtype}")
    return dtype


def _student_operands(q_idx: Tensor, w: Tensor, k_idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    dtype = _student_dtype(q_idx.dtype, k_idx.dtype)
    return q_idx.to(dtype).contiguous(), w.float().contiguous(), k_idx.to(dtype).contiguous()


def sparse_teacher_block_triton(teacher, lo: int, q_idx: Tensor, w: Tensor, k_idx: Tensor, q: Tensor, ckv: Tensor,
                                lse: Tensor, scale: float, row_weight: Tensor, selected: Tensor,
                                config: IndexerLossConfig | None = None) -> None:
    """Run the fused loss forward on one block of rows (``q [R, H, d]``, ``lse [R, H]``, ``q_idx [R, HI, cI]``,
    ...) and store its per-row loss, stats and teacher masses in ``teacher`` (a ``SparseTeacher``) at ``lo``;
    ``config``: the kernels' launch settings (None: the defaults)."""
    hi = lo + q.shape[0]
    if hi == lo or k_idx.shape[0] == 0:
        return
    q_idx, w, k_idx = _student_operands(q_idx.detach(), w.detach(), k_idx.detach())
    sel = selected.to(torch.int64).contiguous()
    indexer_kl_fwd(
        q_idx, w, k_idx, q.detach().contiguous(), ckv.detach().to(q.dtype).contiguous(), lse.float().contiguous(),
        float(scale), row_weight.float().contiguous(), sel, sel[:, 0], sel[:, 0],
        out=(teacher.loss_rows[lo:hi], teacher.stats[lo:hi], teacher.mass[lo:hi]), config=config,
    )
    teacher.geometry = (q.shape[1], q.shape[2], q.dtype)


class IndexerKLFromTeacher(torch.autograd.Function):
    """Scalar loss from precomputed per-row pieces. The backward recomputes the indexer queries one block of rows
    at a time (:class:`StudentQueries`) and runs the backward kernel on the block, reading the stored teacher
    masses; neither ``q_idx`` nor its gradient ever exists for all rows."""

    @staticmethod
    def forward(ctx, query_fn, block_rows, geometry, student_dtype, qr, cos, sin, weight, lora_a, lora_b, w, k_idx,
                loss_rows, row_weight, selected, stats, mass, config):
        # weight, lora_a, lora_b: the queries' params (StudentQueries.params; the pair None without LoRA)
        ctx.query_fn, ctx.block_rows, ctx.geometry, ctx.student_dtype = query_fn, block_rows, geometry, student_dtype
        ctx.config = config
        ctx.save_for_backward(qr, cos, sin, weight, lora_a, lora_b, w, k_idx, row_weight, selected, stats, mass)
        return loss_rows.sum()

    @staticmethod
    def backward(ctx, grad):
        qr, cos, sin, weight, lora_a, lora_b, w, k_idx, row_weight, selected, stats, mass = ctx.saved_tensors
        heads, head_dim, q_dtype = ctx.geometry
        need_qr, need_w, need_k = (ctx.needs_input_grad[i] for i in (4, 10, 11))
        params = [(t, need) for t, need in zip((weight, lora_a, lora_b), ctx.needs_input_grad[7:10]) if t is not None]
        grad = grad.float().reshape(1).contiguous()
        # The sparse backward kernel reads the stored masses, never q, ckv or lse (only q's geometry and dtype
        # pick the compiled variant), so one-element placeholders stand in for them.
        q_shape = torch.empty((1, heads, head_dim), dtype=q_dtype, device=w.device)
        acc = torch.promote_types(weight.dtype, torch.float32)
        dqr = torch.empty_like(qr) if need_qr else None
        sums = [torch.zeros(t.shape, dtype=acc, device=t.device) if need else None for t, need in params]
        dw = torch.empty_like(w) if need_w else None
        dk = torch.zeros(k_idx.shape, dtype=torch.float32, device=k_idx.device)
        k_op = k_idx.to(ctx.student_dtype).contiguous()
        for lo in range(0, qr.shape[0], ctx.block_rows):
            hi = min(lo + ctx.block_rows, qr.shape[0])
            with torch.enable_grad():
                qr_b = qr[lo:hi].detach().requires_grad_(need_qr)
                params_b = [t.detach().requires_grad_(need) for t, need in params]
                q_idx = ctx.query_fn(qr_b, cos[lo:hi], sin[lo:hi], *params_b)
            dq, dw_b, _ = indexer_kl_bwd(grad, q_idx.detach().to(k_op.dtype).contiguous(), w[lo:hi], k_op, q_shape,
                                         q_shape, stats, 0.0, row_weight[lo:hi], selected[lo:hi], stats, stats,
                                         stats[lo:hi], mass[lo:hi], dk_accum=dk, config=ctx.config)
            if need_w:
                dw[lo:hi] = dw_b
            wrt = [t for t in (qr_b, *params_b) if t.requires_grad]
            if wrt:
                got = iter(torch.autograd.grad(q_idx, wrt, dq.to(q_idx.dtype)))
                if need_qr:
                    dqr[lo:hi] = next(got)
                for total in sums:
                    if total is not None:
                        total += next(got)
        dparams = [None if g is None else g.to(t.dtype) for g, (t, _) in zip(sums, params)] + [None, None]
        return _FromTeacherGrads(qr=dqr, weight=dparams[0], lora_a=dparams[1], lora_b=dparams[2], w=dw,
                                 k_idx=dk.to(k_idx.dtype) if need_k else None)


_FromTeacherGrads = named_grads(IndexerKLFromTeacher)


def indexer_kl_from_teacher_triton(queries, w: Tensor, k_idx: Tensor, teacher, row_weight: Tensor,
                                   selected: Tensor, config: IndexerLossConfig | None = None) -> Tensor:
    """The sparse loss from a ``SparseTeacher`` filled by :func:`sparse_teacher_block_triton` (fp32 scalar), its
    backward recomputing the queries from ``queries`` (a ``StudentQueries``) block by block, launched with
    ``config`` (None: the defaults)."""
    qr, params = queries.qr, queries.params
    weight = params[0]
    if k_idx.shape[0] == 0 or qr.shape[0] == 0 or teacher.geometry is None:
        return (qr.sum() + sum(p.sum() for p in params) + w.sum() + k_idx.sum()).float() * 0
    dtype = _student_dtype(torch.promote_types(qr.dtype, weight.dtype), k_idx.dtype)  # that of the forward's student
    lora_a, lora_b = params[1:] if len(params) == 3 else (None, None)
    return IndexerKLFromTeacher.apply(queries.fn, max(1, queries.chunk_rows), teacher.geometry, dtype, qr,
                                      queries.cos, queries.sin, weight, lora_a, lora_b,
                                      w.float().contiguous(), k_idx, teacher.loss_rows, row_weight.float().contiguous(),
                                      selected.to(torch.int64).contiguous(), teacher.stats, teacher.mass, config)
