"""Compressor pooling (gate + position bias, per-channel softmax over r or 2r slots, weighted sum), Triton.

Forward: one program per (entry, channel tile) loads the entry's slots (block i, and for the overlapping CSA
layout the first-half channels of block i-1), runs the softmax over slots in fp32, rounds the weights to the
value dtype as the reference model does, and sums in fp32.

Backward: every (row, channel) of ``kv``/``gate`` feeds exactly one entry (block i's second half -> entry i,
its first half -> entry i+1), so each program writes its own slots of ``dkv``/``dgate`` without atomics. The
position-bias gradient is the sum of ``dgate`` by in-block position; each program adds up its group of entries
and the host sums the small ``[groups, r, width]`` partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..autograd import named_grads

__all__ = ["compress_pool_triton", "compress_pool_fwd", "compress_pool_bwd"]


@triton.jit
def _slots(kv, gate, pb, row0, first, ch, cm, WIDTH: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
           RP: tl.constexpr, OVERLAP: tl.constexpr):
    """Values and fp32 logits of the current block ``[RP, BC]`` and (overlap) the previous block."""
    p = tl.arange(0, RP)
    pm = p < R
    cur_rows = (row0 + p).to(tl.int64)
    cur_ch = ch + C if OVERLAP else ch
    cmask = pm[:, None] & cm[None, :]
    v_cur = tl.load(kv + cur_rows[:, None] * WIDTH + cur_ch[None, :], mask=cmask, other=0.0)
    g_cur = tl.load(gate + cur_rows[:, None] * WIDTH + cur_ch[None, :], mask=cmask, other=0.0).to(tl.float32)
    g_cur += tl.load(pb + p[:, None] * WIDTH + cur_ch[None, :], mask=cmask, other=0.0).to(tl.float32)
    g_cur = tl.where(cmask, g_cur, float("-inf"))
    if OVERLAP:
        prev_rows = (row0 - R + p).to(tl.int64)
        pmask = cmask & ((p * 0 + first) == 0)[:, None]
        v_prev = tl.load(kv + prev_rows[:, None] * WIDTH + ch[None, :], mask=pmask, other=0.0)
        g_prev = tl.load(gate + prev_rows[:, None] * WIDTH + ch[None, :], mask=pmask, other=0.0).to(tl.float32)
        g_prev += tl.load(pb + p[:, None] * WIDTH + ch[None, :], mask=pmask, other=0.0).to(tl.float32)
        g_prev = tl.where(pmask, g_prev, float("-inf"))
    else:
        prev_rows = cur_rows
        pmask = cmask & (p < 0)[:, None]
        v_prev = v_cur
        g_prev = tl.full(g_cur.shape, float("-inf"), tl.float32)
    return cur_rows, cur_ch, cmask, v_cur, g_cur, prev_rows, pmask, v_prev, g_prev


@triton.jit
def _softmax2(g_cur, g_prev, cm):
    mx = tl.maximum(tl.max(g_cur, axis=0), tl.max(g_prev, axis=0))
    mx = tl.where(cm, mx, 0.0)
    e_cur = tl.exp(g_cur - mx[None, :])
    e_prev = tl.exp(g_prev - mx[None, :])
    den = tl.sum(e_cur, axis=0) + tl.sum(e_prev, axis=0)
    den = tl.where(cm, den, 1.0)
    return e_cur / den[None, :], e_prev / den[None, :]


@triton.jit
def compress_pool_fwd_kernel(
    kv, gate, pb, entry_row, entry_first, out,
    WIDTH: tl.constexpr, C: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, BC: tl.constexpr,
    OVERLAP: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = ch < C
    row0 = tl.load(entry_row + e)
    first = tl.load(entry_first + e).to(tl.int32)
    _, _, _, v_cur, g_cur, _, _, v_prev, g_prev = _slots(kv, gate, pb, row0, first, ch, cm, WIDTH, C, R, RP,
                                                         OVERLAP)
    w_cur, w_prev = _softmax2(g_cur, g_prev, cm)
    # Weights are rounded to the value dtype before the weighted sum, as in the reference model.
    acc = tl.sum(w_cur.to(v_cur.dtype).to(tl.float32) * v_cur.to(tl.float32), axis=0)
    if OVERLAP:
        acc += tl.sum(w_prev.to(v_prev.dtype).to(tl.float32) * v_prev.to(tl.float32), axis=0)
    tl.store(out + e * C + ch, acc.to(out.dtype.element_ty), mask=cm)


@triton.jit
def compress_pool_bwd_kernel(
    kv, gate, pb, entry_row, entry_first, dout, dkv, dgate, dpb_part, num_entries,
    WIDTH: tl.constexpr, C: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, BC: tl.constexpr,
    OVERLAP: tl.constexpr, EPB: tl.constexpr,
):
    grp = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = ch < C
    p = tl.arange(0, RP)
    dpb_cur = tl.zeros((RP, BC), dtype=tl.float32)
    dpb_prev = tl.zeros((RP, BC), dtype=tl.float32)
    for i in range(EPB):
        e = (grp * EPB + i).to(tl.int64)
        if e < num_entries:
            row0 = tl.load(entry_row + e)
            first = tl.load(entry_first + e).to(tl.int32)
            cur_rows, cur_ch, cmask, v_cur, g_cur, prev_rows, pmask, v_prev, g_prev = _slots(
                kv, gate, pb, row0, first, ch, cm, WIDTH, C, R, RP, OVERLAP)
            w_cur, w_prev = _softmax2(g_cur, g_prev, cm)
            do = tl.load(dout + e * C + ch, mask=cm, other=0.0).to(tl.float32)
            # out = sum_j round(w_j) v_j: d v_j = round(w_j) do; d w_j = v_j do (the rounding passes the
            # gradient through), then the softmax backward dlogit_j = w_j (dw_j - sum_k w_k dw_k).
            dw_cur = v_cur.to(tl.float32) * do[None, :]
            dw_prev = v_prev.to(tl.float32) * do[None, :]
            dot = tl.sum(w_cur * dw_cur, axis=0)
            if OVERLAP:
                dot += tl.sum(w_prev * dw_prev, axis=0)
            dl_cur = tl.where(cmask, w_cur * (dw_cur - dot[None, :]), 0.0)
            dv_cur = w_cur.to(v_cur.dtype).to(tl.float32) * do[None, :]
            tl.store(dkv + cur_rows[:, None] * WIDTH + cur_ch[None, :], dv_cur.to(dkv.dtype.element_ty), mask=cmask)
            tl.store(dgate + cur_rows[:, None] * WIDTH + cur_ch[None, :], dl_cur.to(dgate.dtype.element_ty),
                     mask=cmask)
            dpb_cur += dl_cur
            if OVERLAP:
                dl_prev = tl.where(pmask, w_prev * (dw_prev - dot[None, :]), 0.0)
                dv_prev = w_prev.to(v_prev.dtype).to(tl.float32) * do[None, :]
                tl.store(dkv + prev_rows[:, None] * WIDTH + ch[None, :], dv_prev.to(dkv.dtype.element_ty),
                         mask=pmask)
                tl.store(dgate + prev_rows[:, None] * WIDTH + ch[None, :], dl_prev.to(dgate.dtype.element_ty),
                         mask=pmask)
                dpb_prev += dl_prev
    pmask2 = (p[:, None] < R) & cm[None, :]
    part = dpb_part + grp.to(tl.int64) * R * WIDTH + p[:, None] * WIDTH
    if OVERLAP:
        tl.store(part + (ch + C)[None, :], dpb_cur, mask=pmask2)
        tl.store(part + ch[None, :], dpb_prev, mask=pmask2)
    else:
        tl.store(part + ch[None, :], dpb_cur, mask=pmask2)


def _tiles(c: int, ratio: int) -> tuple[int, int]:
    rp = max(2, triton.next_power_of_2(ratio))
    # Keep a slot tile near 4k elements: r = 128 -> 32 channels, r = 4 -> 128 channels.
    bc = max(16, min(128, triton.next_power_of_2(c), 4096 // rp))
    return rp, bc


def compress_pool_fwd(kv: Tensor, gate: Tensor, position_bias: Tensor, entry_row: Tensor, entry_first: Tensor,
                      ratio: int, overlap: bool) -> Tensor:
    """Pooled entries ``[Nc, c]`` in ``kv.dtype``."""
    width = kv.shape[1]
    c = width // (2 if overlap else 1)
    num_entries = entry_row.shape[0]
    out = torch.empty((num_entries, c), dtype=kv.dtype, device=kv.device)
    if num_entries == 0:
        return out
    rp, bc = _tiles(c, ratio)
    compress_pool_fwd_kernel[(num_entries, triton.cdiv(c, bc))](
        kv, gate, position_bias, entry_row, entry_first, out,
        WIDTH=width, C=c, R=ratio, RP=rp, BC=bc, OVERLAP=overlap, num_warps=4,
    )
    return out


def compress_pool_bwd(dout: Tensor, kv: Tensor, gate: Tensor, position_bias: Tensor, entry_row: Tensor,
                      entry_first: Tensor, ratio: int, overlap: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dkv [T, width] kv.dtype, dgate [T, width] gate.dtype, dposition_bias [r, width] fp32)``."""
    width = kv.shape[1]
    c = width // (2 if overlap else 1)
    num_entries = entry_row.shape[0]
    dkv = torch.zeros_like(kv)
    dgate = torch.zeros_like(gate)
    rp, bc = _tiles(c, ratio)
    epb = 16
    groups = triton.cdiv(num_entries, epb)
    dpb_part = torch.zeros((max(groups, 1), ratio, width), dtype=torch.float32, device=kv.device)
    if num_entries:
        compress_pool_bwd_kernel[(groups, triton.cdiv(c, bc))](
            kv, gate, position_bias, entry_row, entry_first, dout.contiguous(), dkv, dgate, dpb_part, num_entries,
            WIDTH=width, C=c, R=ratio, RP=rp, BC=bc, OVERLAP=overlap, EPB=epb, num_warps=4,
        )
    return dkv, dgate, dpb_part.sum(0)


class CompressPoolFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, gate, position_bias, entry_row, entry_first, ratio, overlap):
        ctx.save_for_backward(kv, gate, position_bias, entry_row, entry_first)
        ctx.ratio, ctx.overlap = ratio, overlap
        return compress_pool_fwd(kv, gate, position_bias, entry_row, entry_first, ratio, overlap)

    @staticmethod
    def backward(ctx, dout):
        kv, gate, position_bias, entry_row, entry_first = ctx.saved_tensors
        dkv, dgate, dpb = compress_pool_bwd(dout, kv, gate, position_bias, entry_row, entry_first, ctx.ratio,
                                            ctx.overlap)
        return _CompressPoolGrads(kv=dkv, gate=dgate, position_bias=dpb.to(position_bias.dtype))


_CompressPoolGrads = named_grads(CompressPoolFunction)


def compress_pool_triton(
    kv: Tensor,
    gate: Tensor,
    position_bias: Tensor,
    entry_row: Tensor,
    entry_first: Tensor,
    ratio: int,
    overlap: bool,
) -> Tensor:
    """Pool blocks of ``ratio`` rows into compressed entries; contract of ``compress_pool_ref``.

    Args:
        kv: ``[T, coff * c]`` projected values (coff = 2 when ``overlap``); gate: ``[T, coff * c]`` logits.
        position_bias: ``[ratio, coff * c]`` (fp32 in the model) added to the gate logits by in-block position.
        entry_row: ``[Nc]`` int64 first row of each entry's block; entry_first: ``[Nc]`` bool (no previous block).
        ratio: block length r. overlap: CSA layout (2r slots: block i-1's first half, block i's second half).

    Returns:
        ``[Nc, c]`` in ``kv.dtype``; gradients flow to ``kv``, ``gate`` and ``position_bias``.

    Example:
        >>> pooled = compress_pool_triton(kv, gate, ape, meta.entry_row, meta.entry_first, 4, True)
    """
    coff = 2 if overlap else 1
    if kv.dim() != 2 or gate.shape != kv.shape:
        raise ValueError(f"kv and gate must be the same [T, width], got {tuple(kv.shape)}, {tuple(gate.shape)}")
    width = kv.shape[1]
    if width % coff:
        raise ValueError(f"kv width {width} is not divisible by {coff} (overlap={overlap})")
    if position_bias.shape != (ratio, width):
        raise ValueError(f"position_bias must be [{ratio}, {width}], got {tuple(position_bias.shape)}")
    if entry_row.shape != entry_first.shape or entry_row.dim() != 1:
        raise ValueError("entry_row and entry_first must be [Nc]")
    return CompressPoolFunction.apply(
        kv.contiguous(), gate.contiguous(), position_bias.contiguous(), entry_row.to(torch.int64).contiguous(),
        entry_first.to(torch.int32).contiguous(), ratio, overlap,
    )
