"""Fused lightning-indexer scores and exact causal top-k (Triton).

Two passes over a bounded workspace, never the whole ``[T, Nc]`` score matrix at once:

1. ``indexer_scores_fwd_kernel``: for a tile of rows and a tile of keys, ``sum_h w[t,h] * relu(q[t,h] . k)``
   with one ``tl.dot`` per head (the key tile is loaded once and reused by every head), fp32 accumulation,
   written to a row-chunk workspace as int32 keys that order like the scores. Tiles outside every row's
   visible range are skipped.
2. ``indexer_topk_select_kernel``: per row, the exact k-th largest key by bisection with the row alone in
   registers (one block-wide count a step, then over the last bracket's keys alone), then one pass over the row
   in tiles that writes the taken ids (keys above the threshold, plus the lowest ids among those equal to it) in
   ascending order and -1 after them: the same list as ``indexer_topk_ref``.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend import interpreting
from .config import IndexerConfig

__all__ = ["IndexerConfig", "indexer_scores_fwd", "indexer_topk_triton", "select_topk"]

# Rows of the workspace are at most this many bytes apart from the budget the caller gives; the default keeps
# the transient scores of one chunk well under the layer's activation memory.
_MAX_WORKSPACE = 256 << 20

_DEFAULT = IndexerConfig()


@triton.jit
def _head_logits(q_ptr, q_mask, k_t, IEEE: tl.constexpr):
    """``q_h [BT, cI] @ k_t [cI, BK]`` of one head, fp32 accumulation (IEEE fp32 products for fp32 inputs)."""
    q_h = tl.load(q_ptr, mask=q_mask, other=0.0)
    if IEEE:
        return tl.dot(q_h, k_t, input_precision="ieee")
    return tl.dot(q_h, k_t)


@triton.jit
def indexer_scores_fwd_kernel(
    q, q_desc, w, k, vis_start, vis_end, scores,
    row_lo, num_rows, key_lo, num_keys, stride_s,
    HI: tl.constexpr, CI: tl.constexpr, CIP: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, ORDERED_KEYS: tl.constexpr,
    TMA: tl.constexpr = False,
):
    # Key tiles vary fastest so the programs running together share one row block's queries in L2.
    pid_k = tl.program_id(0)
    pid_t = tl.program_id(1)
    local = pid_t * BT + tl.arange(0, BT)
    row_mask = local < num_rows
    rows = row_lo + local
    starts = tl.load(vis_start + rows, mask=row_mask, other=2**62)
    ends = tl.load(vis_end + rows, mask=row_mask, other=0)
    first_key = key_lo + pid_k * BK
    # Skip key tiles no row of this block may see (the causal triangle and other documents).
    if (first_key < tl.max(ends, axis=0)) & (first_key + BK > tl.min(starts, axis=0)):
        keys = first_key + tl.arange(0, BK)
        key_mask = keys < key_lo + num_keys
        ch = tl.arange(0, CIP)
        ch_mask = ch < CI
        k_t = tl.load(k + keys[None, :].to(tl.int64) * CI + ch[:, None],
                      mask=key_mask[None, :] & ch_mask[:, None], other=0.0)
        acc = tl.zeros((BT, BK), dtype=tl.float32)
        q_ptr = q + rows[:, None].to(tl.int64) * (HI * CI) + ch[None, :]
        w_ptr = w + rows.to(tl.int64) * HI
        q_mask = row_mask[:, None] & ch_mask[None, :]
        for h in range(HI):
            if TMA:
                # the tensor-memory unit brings the [BT, cI] block (rows past T read as zeros)
                logits = tl.dot(q_desc.load([row_lo + pid_t * BT, h * CI]), k_t)
            else:
                logits = _head_logits(q_ptr + h * CI, q_mask, k_t, IEEE)
            w_h = tl.load(w_ptr + h, mask=row_mask, other=0.0)
            acc += w_h[:, None] * tl.maximum(logits, 0.0)
        out = scores + local[:, None].to(tl.int64) * stride_s + (keys - key_lo)[None, :]
        if ORDERED_KEYS:
            # Order-preserving int32 image of the fp32 score (-0.0 folded into +0.0 so it ties with it, as in
            # a float sort): the selection pass compares integers only.
            acc = tl.where(acc == 0.0, 0.0, acc)
            bits = acc.to(tl.int32, bitcast=True)
            tl.store(out, bits ^ ((bits >> 31) & 0x7FFFFFFF), mask=row_mask[:, None] & key_mask[None, :])
        else:
            tl.store(out, acc, mask=row_mask[:, None] & key_mask[None, :])


@triton.jit
def _bisect_step(lo, hi, above, mid, cnt, kk):
    """One bisection step for the largest ``thr`` with ``count(key >= thr) >= kk``, given ``cnt = count(key >=
    mid)``. A step that lowers ``hi`` to ``mid - 1`` has just counted the keys ``>= mid``, which are the keys
    above the final threshold if ``hi`` moves no more, so ``above`` needs no pass of its own."""
    take = cnt >= kk
    return tl.where(take, mid, lo), tl.where(take, hi, mid - 1), tl.where(take, above, cnt)


@triton.jit
def _count_min_max(c0, lo0, hi0, c1, lo1, hi1):
    return c0 + c1, tl.minimum(lo0, lo1), tl.maximum(hi0, hi1)


@triton.jit
def _bisect_regs(key, kk, n, row, ids, ck, CAND: tl.constexpr, SEG: tl.constexpr, GATHER: tl.constexpr = True):
    """``(thr, above, gathered)``: the kk-th largest of the in-register int32 row ``key`` (``n`` real keys, then
    padding with INT32_MIN; ``kk <= n``; the same keys are at ``row`` in memory), how many keys are above it, and
    how many ids (those of the keys at or above the last whole-row bracket) were gathered to ``ids``: 0 when the
    whole-row counts found the threshold or ``GATHER`` is off (then :func:`_compact` reads the whole row), else
    :func:`_compact_gathered` writes the row's list from them.

    The bracket ``[lo, hi]`` always holds the threshold: ``count(key >= lo) = c_lo >= kk`` and ``count(key > hi) =
    above < kk``. While it holds more than ``CAND`` keys, one block-wide count of the whole row a step halves it.
    Then one pass over the row in ``SEG`` tiles (from L2) gathers, in id order, the ids of every key ``>= lo`` to
    ``ids`` (fewer than ``kk + CAND``: the keys above the bracket and the bracket's own) and the bracket's keys to
    ``ck``; the search goes on over those keys alone (a count there plus the keys above the bracket is the row's
    count), each step moving the bound it sets onto the nearest key beyond the midpoint, so it ends after about
    ``log2(CAND)`` short steps instead of one per remaining bit. The gathered ids hold every id the row takes, so
    the list is written from them and the row is not read a third time.
    """
    lo = tl.full((), -(2**31), tl.int64)
    hi = tl.max(key, axis=0).to(tl.int64)
    c_lo = n.to(tl.int32)
    above = tl.zeros((), dtype=tl.int32)
    while (lo < hi) & (c_lo - above > CAND):
        mid = lo + (hi - lo + 1) // 2
        cnt = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
        c_lo = tl.where(cnt >= kk, cnt, c_lo)
        lo, hi, above = _bisect_step(lo, hi, above, mid, cnt, kk)
    gathered = tl.zeros((), dtype=tl.int32)
    if GATHER:
        gathered = tl.where(lo < hi, c_lo, 0)
    if lo < hi:
        # A scan over the in-register row would hold its ranks beside it, and those registers would cost programs
        # per SM: the row is read again in tiles. One scan a tile ranks the keys >= lo (low 16 bits) and the
        # bracket's keys (high 16 bits).
        lo32 = lo.to(tl.int32)
        hi32 = hi.to(tl.int32)
        seen = tl.zeros((), dtype=tl.int32)
        for j in tl.range(0, n, SEG, num_stages=3):
            offs = j + tl.arange(0, SEG)
            tile = tl.load(row + offs, mask=offs < n, other=-(2**31))
            ge = (offs < n) & (tile >= lo32)
            inside = ge & (tile <= hi32)
            code = ge.to(tl.int32) | (inside.to(tl.int32) << 16)
            ranks = seen + tl.cumsum(code, axis=0)
            if GATHER:
                tl.store(ids + (ranks & 0xFFFF) - 1, offs, mask=ge)
            tl.store(ck + (ranks >> 16) - 1, tile, mask=inside)
            seen += tl.sum(code, axis=0)
        tl.debug_barrier()  # the gathered keys are read back by other threads of the program
        offs = tl.arange(0, CAND)
        cand = tl.load(ck + offs, mask=offs < c_lo - above, other=-(2**31))
        outside = above  # the keys above the gathered bracket: a count over `cand` misses exactly these
        while lo < hi:
            mid = (lo + (hi - lo + 1) // 2).to(tl.int32)
            ge = cand >= mid
            cnt, nxt_lo, nxt_hi = tl.reduce(
                (ge.to(tl.int32), tl.where(ge, cand, 2**31 - 1), tl.where(ge, -(2**31), cand)), 0, _count_min_max)
            cnt += outside
            take = cnt >= kk
            # take: some key >= mid exists (cnt >= kk > above); else some key in [lo, mid) does (c_lo >= kk > cnt)
            lo = tl.where(take, nxt_lo.to(tl.int64), lo)
            hi = tl.where(take, hi, nxt_hi.to(tl.int64))
            above = tl.where(take, above, cnt)
        tl.debug_barrier()  # every thread has read its keys before the list overwrites the scratch
    return lo.to(tl.int32), above, gathered


@triton.jit
def _bisect_stream(base, start, end, kk, BK: tl.constexpr):
    """``_bisect_regs`` for a row too long for registers: every step streams the row in ``BK`` tiles."""
    lo = tl.full((), -(2**31), tl.int64)
    hi = tl.full((), -(2**31), tl.int64)
    for j in range(start, end, BK):
        offs = j + tl.arange(0, BK)
        hi = tl.maximum(hi, tl.max(tl.load(base + offs, mask=offs < end, other=-(2**31)), axis=0).to(tl.int64))
    above = tl.zeros((), dtype=tl.int32)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        cnt = tl.zeros((), dtype=tl.int32)
        for j in range(start, end, BK):
            offs = j + tl.arange(0, BK)
            key = tl.load(base + offs, mask=offs < end, other=-(2**31))
            cnt += tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
        lo, hi, above = _bisect_step(lo, hi, above, mid, cnt, kk)
    return lo.to(tl.int32), above


@triton.jit
def _rank_taken(key, valid, thr, need_eq, gt_seen, eq_seen):
    """``(sel, slot, total)`` of keys in id order: which are taken (every valid key above ``thr``, and those equal
    to it while fewer than ``need_eq`` equal ones come before them: the lowest ids), and each taken key's slot in
    the list, after ``gt_seen`` keys above and ``eq_seen`` equal ones in earlier tiles. One scan ranks both kinds,
    keys above in the low 16 bits and keys equal in the high 16 (at most 2^14 keys a call); ``total`` packs the
    tile's two counts the same way."""
    gt = valid & (key > thr)
    eq = valid & (key == thr)
    code = gt.to(tl.int32) | (eq.to(tl.int32) << 16)
    ranks = tl.cumsum(code, axis=0)
    eq_upto = eq_seen + (ranks >> 16)  # keys equal to thr up to this one, itself included
    sel = gt | (eq & (eq_upto <= need_eq))
    slot = gt_seen + (ranks & 0xFFFF) + tl.minimum(eq_upto, need_eq) - 1
    return sel, slot, tl.sum(code, axis=0)


@triton.jit
def _fill_unused(out_row, kk, topk, SEG: tl.constexpr):
    """``-1`` in the slots ``[kk, topk)`` of the row's list."""
    for p in range(kk, topk, SEG):
        slots = p + tl.arange(0, SEG)
        tl.store(out_row + slots, tl.full((SEG,), -1, tl.int64), mask=slots < topk)


@triton.jit
def _compact(base, start, end, thr, need_eq, kk, key_lo, out_row, topk, SEG: tl.constexpr):
    """Write the row's ids in ascending order: every key above ``thr`` and the first ``need_eq`` keys equal to it
    (the lowest ids), then ``-1`` up to ``topk`` (a row taking all its keys passes INT32_MIN and ``need_eq = kk``).

    The row is read again in ``SEG`` tiles (from L2: the threshold search has just read it), so only one tile's
    ranks, keys and addresses are live at a time and the search keeps the row alone in registers; the ranks
    (:func:`_rank_taken`) carry from tile to tile. The tiles' loads are pipelined (``tl.range`` stages): the scan
    of one tile overlaps the L2 reads of the next.
    """
    gt_seen = tl.zeros((), dtype=tl.int32)
    eq_seen = tl.zeros((), dtype=tl.int32)
    for j in tl.range(start, end, SEG, num_stages=3):
        offs = j + tl.arange(0, SEG)
        inside = offs < end
        key = tl.load(base + offs, mask=inside, other=-(2**31))
        sel, slot, total = _rank_taken(key, inside, thr, need_eq, gt_seen, eq_seen)
        tl.store(out_row + slot, key_lo + offs.to(tl.int64), mask=sel)
        gt_seen += total & 0xFFFF
        eq_seen += total >> 16
    _fill_unused(out_row, kk, topk, SEG)


@triton.jit
def _compact_gathered(row, ids, count, thr, need_eq, kk, id_lo, out_row, topk, MB: tl.constexpr,
                      SEG: tl.constexpr):
    """:func:`_compact` over the ``count`` gathered ids (ascending, ``count <= MB``; their keys read back from
    ``row``) instead of the whole row. ``ids`` may share memory with ``out_row``: every id is read before any is
    written."""
    offs = tl.arange(0, MB)
    real = offs < count
    rel = tl.load(ids + offs, mask=real, other=0)
    key = tl.load(row + rel, mask=real, other=-(2**31))
    zero = tl.zeros((), dtype=tl.int32)
    sel, slot, _ = _rank_taken(key, real, thr, need_eq, zero, zero)
    tl.debug_barrier()  # the ids share memory with the list
    tl.store(out_row + slot, id_lo + rel.to(tl.int64), mask=sel)
    _fill_unused(out_row, kk, topk, SEG)


@triton.jit
def indexer_topk_select_kernel(
    scores, vis_start, vis_end, out,
    row_lo, key_lo, stride_s, topk,
    BK: tl.constexpr, RB: tl.constexpr, IN_REGS: tl.constexpr, SEG: tl.constexpr, CAND: tl.constexpr,
    MB: tl.constexpr, GATHER: tl.constexpr = True,
):
    """Row ``row_lo + program`` of ``out``: the ids of its ``min(visible, topk)`` best keys in ascending order
    (ties to the lower id), then -1. The row of ``out`` (``8 * topk`` bytes: ``2 * topk`` int32 slots) is also the
    threshold search's scratch until the ids are written: the gathered ids (fewer than ``topk + CAND <= MB``) from
    slot 0, the bracket's keys in the last ``CAND`` slots (``2 * CAND <= topk + 1``, so the two never meet). The
    gathered list is ranked in one scan of 16-bit counts, so ``GATHER`` is off where it would exceed ``2^14`` ids
    (k above 16k; ``MB`` is then unused)."""
    tl.static_assert(SEG <= 2**14, "the compaction packs two ranks into the 16-bit halves of an int32")
    tl.static_assert(MB <= 2**14, "the gathered list is ranked in one scan of 16-bit counts")
    t = tl.program_id(0)
    row = row_lo + t
    start = (tl.load(vis_start + row) - key_lo).to(tl.int32)
    end = (tl.load(vis_end + row) - key_lo).to(tl.int32)
    n = tl.maximum(end - start, 0)
    kk = tl.minimum(n, topk)
    base = scores + t.to(tl.int64) * stride_s
    out_row = out + row.to(tl.int64) * topk
    # thr = the kk-th largest key: every key above it is taken and need_eq of the keys equal to it, the lowest
    # ids first; a row with at most topk keys takes them all (every key is >= INT32_MIN).
    thr = tl.full((), -(2**31), tl.int32)
    need_eq = kk
    gathered = tl.zeros((), dtype=tl.int32)
    scratch = out_row.to(tl.pointer_type(tl.int32))
    if n > topk:
        if IN_REGS:
            # Keys past the row read as INT32_MIN: every threshold tried is above it, so counts need no mask.
            rel = tl.arange(0, RB)
            key = tl.load(base + start + rel, mask=rel < n, other=-(2**31))
            thr, above, gathered = _bisect_regs(key, kk, n, base + start, scratch, scratch + 2 * topk - CAND,
                                                CAND, SEG, GATHER)
        else:
            thr, above = _bisect_stream(base, start, end, kk, BK)
        need_eq = kk - above
    if gathered > 0:
        _compact_gathered(base + start, scratch, gathered, thr, need_eq, kk, key_lo + start, out_row, topk, MB, SEG)
    else:
        _compact(base, start, end, thr, need_eq, kk, key_lo, out_row, topk, SEG)


def _compute_dtype(q: Tensor, k: Tensor) -> torch.dtype:
    dtype = torch.promote_types(q.dtype, k.dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"indexer kernels take fp32/bf16/fp16 inputs, got q {q.dtype} and k {k.dtype}")
    return dtype


def indexer_scores_fwd(
    q: Tensor, w: Tensor, k: Tensor, vis_start: Tensor, vis_end: Tensor,
    row_lo: int, row_hi: int, key_lo: int, key_hi: int, out: Tensor | None = None, ordered_keys: bool = False,
    config: IndexerConfig | None = None,
) -> Tensor:
    """Scores of rows ``[row_lo, row_hi)`` against keys ``[key_lo, key_hi)``.

    Args:
        q: ``[T, HI, cI]``; w: ``[T, HI]`` fp32; k: ``[Nc, cI]`` (same dtype as ``q``).
        vis_start, vis_end: ``[T]`` int64 visible id range of each row; tiles nobody sees are left unwritten.
        config: tiles and warps (:class:`IndexerConfig`; None: the defaults).

    Returns:
        ``[row_hi - row_lo, key_hi - key_lo]`` fp32 (entries outside a row's range are undefined), or with
        ``ordered_keys`` int32 keys that order like the scores (what the selection pass reads).
    """
    num_rows, num_keys = row_hi - row_lo, key_hi - key_lo
    if out is None:
        dtype = torch.int32 if ordered_keys else torch.float32
        out = torch.empty((num_rows, num_keys), dtype=dtype, device=q.device)
    heads, ci = q.shape[1], q.shape[2]
    cfg = config or _DEFAULT
    bt, bk = cfg.bt, cfg.bk
    grid = (triton.cdiv(num_keys, bk), triton.cdiv(num_rows, bt))
    # tma=1: query blocks by TMA on Hopper and later (16-bit inputs whose head width is a power of two, so that
    # a block is one head's channels)
    tma = (bool(cfg.tma) and q.dtype != torch.float32 and ci == triton.next_power_of_2(ci) and ci >= 16
           and (not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] >= 9))
    q_desc = q
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        q_desc = TensorDescriptor.from_tensor(q.view(q.shape[0], heads * ci), [bt, ci])
    indexer_scores_fwd_kernel[grid](
        q, q_desc, w, k, vis_start, vis_end, out,
        row_lo, num_rows, key_lo, num_keys, out.stride(0),
        HI=heads, CI=ci, CIP=max(16, triton.next_power_of_2(ci)), BT=bt, BK=bk,
        IEEE=q.dtype == torch.float32, ORDERED_KEYS=ordered_keys, TMA=tma, num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    return out


def _chunks(vis_start: Tensor, vis_end: Tensor, budget: int) -> list[tuple[int, int, int, int, int]]:
    """Row chunks of fixed height whose ``rows x slab`` 4-byte workspace fits ``budget``, each with the widest
    visible range of its rows (two host reads: the sizes, then the chunk bounds that depend on them).

    A suffix min of ``vis_start`` and a prefix max of ``vis_end`` bound every row of a chunk, so
    ``[starts[lo], ends[hi-1])`` covers it (tight for packed documents, whose ranges grow with the rows); the
    slab is at most the whole key range, which fixes the height. The widest row of each chunk sizes that
    chunk's selection (early rows of a document see few keys).

    The plan depends on the ranges only, and every CSA layer of a step selects over the same ranges, so it is
    kept on ``vis_end`` (with ``vis_start``'s identity and both version counters, so an in-place edit or another
    ``vis_start`` recomputes it): the host reads happen once a pack, not once a layer.
    """
    memo_key = None
    if not (vis_start.is_inference() or vis_end.is_inference()):
        memo_key = (budget, vis_start._version, vis_end._version)
        memo = getattr(vis_end, "_csattn_topk_chunks", None)
        if memo is not None and memo[0] == memo_key and memo[1]() is vis_start:
            return memo[2]
    num_rows = vis_start.shape[0]
    ends = torch.cummax(vis_end, dim=0).values
    starts = torch.flip(torch.cummin(torch.flip(vis_start, (0,)), dim=0).values, (0,))
    width = int(ends[-1] - starts[0])
    height = max(64, budget // (4 * max(width, 1)) // 64 * 64)
    los = torch.arange(0, num_rows, height, device=vis_start.device)
    his = torch.clamp(los + height, max=num_rows)
    widths = torch.nn.functional.pad((vis_end - vis_start).clamp_min(0), (0, los.shape[0] * height - num_rows))
    widest = widths.view(-1, height).amax(dim=1)
    bounds = torch.stack([los, his, starts[los], ends[his - 1], widest], dim=1).tolist()
    plan = [(lo, hi, klo, max(khi, klo), wide) for lo, hi, klo, khi, wide in bounds]
    if memo_key is not None:
        vis_end._csattn_topk_chunks = (memo_key, weakref.ref(vis_start), plan)
    return plan


@torch.no_grad()
def indexer_topk_triton(
    q: Tensor,
    w: Tensor,
    k: Tensor,
    vis_start: Tensor,
    vis_end: Tensor,
    topk: int,
    workspace_bytes: int = 1 << 30,
    config: IndexerConfig | None = None,
) -> Tensor:
    """Causal top-k of indexer scores per row; same contract and result as ``indexer_topk_ref``.

    Args:
        q: ``[T, HI, cI]`` fp32/bf16; w: ``[T, HI]`` (fp32 in the model); k: ``[Nc, cI]``.
        vis_start, vis_end: ``[T]`` int64, row t may pick ids in ``[vis_start[t], vis_end[t])``; ranges are
            ordered with the rows (packed documents).
        topk: width of the result (>= 1).
        workspace_bytes: bound on one chunk's fp32 scores workspace (capped at 256 MiB).
        config: the kernels' launch settings (:class:`IndexerConfig`; None: the defaults).

    Returns:
        ``[T, topk]`` int64 global key ids of each row's ``topk`` best keys (ties go to the lower id) in
        ascending id order; unused slots are -1.

    Example:
        >>> ids = indexer_topk_triton(q, w, k, meta.vis_start, meta.vis_end, 512)
    """
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if q.dim() != 3 or w.shape != q.shape[:2] or k.dim() != 2 or k.shape[1] != q.shape[2]:
        raise ValueError(f"q must be [T, HI, cI], w [T, HI], k [Nc, cI]; got {tuple(q.shape)}, "
                         f"{tuple(w.shape)}, {tuple(k.shape)}")
    if vis_start.shape != (q.shape[0],) or vis_end.shape != (q.shape[0],):
        raise ValueError("vis_start and vis_end must be [T]")
    interpret = interpreting()
    if not q.is_cuda and not interpret:
        raise ValueError("indexer_topk_triton needs CUDA tensors (or TRITON_INTERPRET=1)")
    num_rows = q.shape[0]
    if num_rows == 0 or k.shape[0] == 0:
        return torch.full((num_rows, topk), -1, dtype=torch.int64, device=q.device)
    out = torch.empty((num_rows, topk), dtype=torch.int64, device=q.device)  # the selection writes every slot
    dtype = _compute_dtype(q, k)
    q = q.to(dtype).contiguous()
    k = k.to(dtype).contiguous()
    w = w.float().contiguous()
    vis_start = vis_start.to(torch.int64).contiguous()
    vis_end = vis_end.to(torch.int64).contiguous()
    budget = max(1, min(workspace_bytes, _MAX_WORKSPACE))
    workspace = None
    for lo, hi, key_lo, key_hi, widest in _chunks(vis_start, vis_end, budget):
        if key_hi <= key_lo:
            out[lo:hi] = -1  # no row of the chunk sees a key
            continue
        need = (hi - lo) * (key_hi - key_lo)
        if workspace is None or workspace.numel() < need:
            workspace = torch.empty(need, dtype=torch.int32, device=q.device)
        scores = workspace[:need].view(hi - lo, key_hi - key_lo)
        indexer_scores_fwd(q, w, k, vis_start, vis_end, lo, hi, key_lo, key_hi, out=scores, ordered_keys=True,
                           config=config)
        select_topk(scores, vis_start, vis_end, out, lo, key_lo, widest, config=config)
    return out


def select_topk(scores: Tensor, vis_start: Tensor, vis_end: Tensor, out: Tensor, row_lo: int, key_lo: int,
                widest: int, config: IndexerConfig | None = None) -> None:
    """Exact top-k of the workspace rows ``scores [R, K]`` (ordered int32 keys of ids ``key_lo..``) into every
    slot of ``out[row_lo : row_lo + R]`` (ids ascending, then -1); ``widest`` bounds the rows' visible ranges."""
    topk = out.shape[1]
    cfg = config or _DEFAULT
    # Rows up to register_row keys search their threshold in registers (at least one warp per 4096 keys), longer
    # ones stream their workspace row. The search gathers its last candidates in the row of `out` (8 * topk bytes).
    rb = max(16, triton.next_power_of_2(max(widest, 1)))
    in_regs = rb <= cfg.register_row
    # the gathered ids (fewer than topk + cand) and the bracket's keys (cand) share the row of out (2 * topk int32)
    cand = 1 << (min(cfg.cand, (topk + 1) // 2).bit_length() - 1)
    mb = triton.next_power_of_2(topk + cand)
    gather = mb <= 2**14
    indexer_topk_select_kernel[(scores.shape[0],)](
        scores, vis_start, vis_end, out, row_lo, key_lo, scores.stride(0), topk,
        BK=1024, RB=rb if in_regs else 16, IN_REGS=in_regs, SEG=cfg.seg, CAND=cand,
        MB=mb if gather else 16, GATHER=gather,
        num_warps=max(cfg.select_warps, rb // 4096) if in_regs else 16,
    )
