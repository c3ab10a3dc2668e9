"""Triton kernels of the FP8 ops: the fused 1x128 activation quantizer and the block-scaled grouped GEMM over
expert-sorted rows (also the dense FP8 linear's fallback: one group). Same math as :mod:`.naive`.

Grouped GEMM: ``out[rows of e] = a[rows of e] @ B_e`` with ``B_e = W_e^T`` (``trans=False``) or ``W_e``
(``trans=True``): only the strides that walk the weight differ, the kernel is one. Each 128-deep step of the
contraction is one block of both scales: its MMA goes to a fresh fp32 accumulator, which is then added with the
product of the activation row scales and the weight block scales (DeepGEMM's promotion), so the scales never
touch the FP8 operands. In the W8A16 mode the activation stays bf16 and the FP8 weight tile is cast to bf16 in
registers (exact: e4m3 is a subset of bf16); the promotion then applies the weight scale alone.

Tiles find their group on the device: a program's row-tile index is located in the running sum of the groups'
tile counts (``ceil(rows_e / BM)``, from ``offs``) by a vector compare; the grid is sized by the static bound
``ceil(M / BM) + E + 1`` row tiles and the programs past the last tile return at once. No host read. A virtual
last group covers the rows past ``offs[-1]`` and writes zeros there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend import interpreting
from .naive import BLOCK, FP8_DTYPE, FP8_MAX

__all__ = ["quantize_1x128_triton", "quantize_rows_triton", "grouped_mm_triton", "low_rank_add_triton",
           "transpose_codes_triton"]


@triton.jit
def _round_e4m3(v):
    """``v`` (``|v| <= 448``) rounded to the nearest e4m3 value, ties to even, in fp32: the later cast is then exact.
    Done by hand because Triton's CPU interpreter drops the exponent carry when rounding to e4m3 (124.3 -> 64);
    on the GPU it is the same RTNE the hardware conversion does."""
    e = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    ulp = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3): e4m3 keeps 3 mantissa bits
    t = v * ((130 - e) << 23).to(tl.float32, bitcast=True)  # v / ulp, exact: times a power of two
    r = (t + 12582912.0) - 12582912.0  # 1.5 * 2^23: rounds |t| < 2^22 to an integer, ties to even
    return tl.where(r == 0.0, t * 0.0, r) * ulp  # keeps the sign of zero, as the conversion does


@triton.jit
def quantize_tile(v, FP8MAX: tl.constexpr, BY_HAND: tl.constexpr):
    """One 1x128 tile per row of ``v [BR, 128]`` (fp32; zeros past the data) -> (``q`` fp32, ``s [BR]``): the
    quantizer's arithmetic, shared with the kernels that quantize what they produce (the MoE's SwiGLU), so that
    theirs is :func:`quantize_1x128_triton`'s bit for bit. ``BY_HAND`` (the CPU interpreter): ``q`` already rounded
    to e4m3 values; else the clamped quotient, which the store's e4m3 conversion (RTNE) rounds to the same bits for
    ~10 fewer instructions an element (the SwiGLU kernels are bound by their instructions, not their bytes)."""
    amax = tl.max(tl.abs(v), axis=1)
    # IEEE divisions (div_rn): Triton's `/` on fp32 is the approximate one, and the scales and values must be the
    # reference's bit for bit
    scale = tl.where(amax == 0.0, 1.0, tl.div_rn(amax, FP8MAX))
    if BY_HAND:
        q = _round_e4m3(tl.minimum(tl.maximum(tl.div_rn(v, scale[:, None]), -FP8MAX), FP8MAX))
    else:
        q = tl.minimum(tl.maximum(_quotient(v, scale), -FP8MAX), FP8MAX)
    return q, scale


@triton.jit
def _quotient(v, scale):
    """``v / scale[:, None]`` rounded to nearest (``div_rn``'s bits) from one IEEE reciprocal a row: ``q0 = v r``
    within an ulp, its remainder ``v - q0 scale`` exact by an FMA, and ``q0 + rem r`` rounded is the quotient
    rounded (Markstein's theorem, ``r`` the reciprocal rounded), where the quotient is a normal number; below that
    it may differ, but the e4m3 rounding takes any |q| < 2^-10 to zero. A row of scale below 2^-90 (its reciprocal
    would overflow, its remainders underflow) is divided as ``(v 2^64) / (scale 2^64)``, exact powers of two. ~5
    instructions an element against ``div_rn``'s ~10 with its range check and branch: the SwiGLU kernels that
    quantize are bound by their instructions (on an H100 at 7424586 the backward's 0.733 ms against 0.815). A zero
    keeps its sign (``q0``): the remainder's sum would make -0 into +0."""
    k = tl.where(scale < 8.077935669463161e-28, 1.8446744073709552e19, 1.0)[:, None]  # 2^-90, 2^64
    s = scale[:, None] * k
    v = v * k
    r = tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    q0 = v * r
    rem = tl.fma(-q0, s, v)
    return tl.where(q0 == 0.0, q0, tl.fma(rem, r, q0))


@triton.jit
def _quantize_kernel(x, q, s, M, K, stride_xm, stride_qm, stride_sm, stride_sk,
                     BR: tl.constexpr, BK: tl.constexpr, FP8MAX: tl.constexpr, BY_HAND: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    rmask = rows < M
    mask = rmask[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    v = tl.load(x + r64 * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    qv, scale = quantize_tile(v, FP8MAX, BY_HAND)
    tl.store(q + r64 * stride_qm + cols[None, :], qv.to(q.dtype.element_ty), mask=mask)
    tl.store(s + rows.to(tl.int64) * stride_sm + tl.program_id(1) * stride_sk, scale, mask=rmask)


@triton.jit
def _quantize_rows_kernel(x, dest, q, s, M, K, stride_xm, stride_qm, stride_sm, COPIES: tl.constexpr,
                          BR: tl.constexpr, BK: tl.constexpr, KB_P2: tl.constexpr, FP8MAX: tl.constexpr,
                          BY_HAND: tl.constexpr):
    """Rows ``[BR]`` of ``x`` over all their column tiles, each tile's codes written into the rows ``dest[row,
    :COPIES]`` as it is made, the scales gathered into ``[BR, KB_P2]`` and written last, a whole row of them a copy
    (a scale written alone would fill 4 bytes of a 32-byte sector: on an H100 at 780aa4a the tile-a-program form
    took 0.32 ms at 16k x 4096 x 6 copies)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < M
    r64 = rows.to(tl.int64)
    tiles = tl.arange(0, KB_P2)
    scales = tl.zeros([BR, KB_P2], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        cols = kb * BK + tl.arange(0, BK)
        mask = rmask[:, None] & (cols < K)[None, :]
        v = tl.load(x + r64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        qv, scale = quantize_tile(v, FP8MAX, BY_HAND)
        qv = qv.to(q.dtype.element_ty)
        for j in tl.static_range(COPIES):  # the destinations re-read each tile: L1 hits, no registers held
            row = tl.load(dest + r64 * COPIES + j, mask=rmask, other=0)
            tl.store(q + row[:, None] * stride_qm + cols[None, :], qv, mask=mask)
        scales = tl.where(tiles[None, :] == kb, scale[:, None], scales)
    smask = rmask[:, None] & (tiles < tl.cdiv(K, BK))[None, :]
    for j in tl.static_range(COPIES):
        row = tl.load(dest + r64 * COPIES + j, mask=rmask, other=0)
        tl.store(s + row[:, None] * stride_sm + tiles[None, :], scales, mask=smask)


def quantize_1x128_triton(x: Tensor, scale_t: bool = False,
                          out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The fused quantizer: one read of ``x [M, K]`` (K-contiguous), ``q [M, K]`` e4m3 and ``s [M, ceil(K/128)]``
    written once. ``scale_t``: ``s`` stored transposed (``[ceil(K/128), M]`` in memory, returned as its
    ``[M, ceil(K/128)]`` view), the layout ``torch._scaled_mm`` takes for its blockwise ``scale_a``. ``out``:
    ``(q, s)`` to write into (the tests poison them)."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    kb = triton.cdiv(k, BLOCK)
    if out is not None:
        q, s = out
    else:
        q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
        s = torch.empty((kb, m), dtype=torch.float32, device=x.device).t() if scale_t else \
            torch.empty((m, kb), dtype=torch.float32, device=x.device)
    br = 4 if interpreting() else 32
    if m and k:
        _quantize_kernel[(triton.cdiv(m, br), kb)](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                                   BR=br, BK=BLOCK, FP8MAX=FP8_MAX, BY_HAND=interpreting(),
                                                   num_warps=4)
    return q, s


def quantize_rows_triton(x: Tensor, dest: Tensor, out: tuple[Tensor, Tensor] | None = None,
                         rows: int = 8, warps: int = 4) -> tuple[Tensor, Tensor]:
    """:func:`quantize_1x128_triton`'s bits written into rows ``dest [M, c]`` (int64, a permutation of ``[0, M c)``)
    of ``q [M c, K]`` and ``s [M c, ceil(K/128)]`` (row-major): ``x`` read once, each row's tiles and scales written
    ``c`` times, whole rows (:func:`~csattn.ops.fp8.quantize_1x128_rows`). ``out``: ``(q, s)`` to write into;
    ``rows`` / ``warps``: a program's rows and warps."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    c, kb = dest.shape[1], triton.cdiv(k, BLOCK)
    q, s = out if out is not None else (torch.empty((m * c, k), dtype=FP8_DTYPE, device=x.device),
                                        torch.empty((m * c, kb), dtype=torch.float32, device=x.device))
    if m and k:
        _quantize_rows_kernel[(triton.cdiv(m, rows),)](
            x, dest.contiguous(), q, s, m, k, x.stride(0), q.stride(0), s.stride(0), COPIES=c,
            BR=rows, BK=BLOCK, KB_P2=triton.next_power_of_2(kb), FP8MAX=FP8_MAX, BY_HAND=interpreting(),
            num_warps=warps)
    return q, s


@triton.jit
def _group_of_tile(offs, pid_m, M, E, BM: tl.constexpr, E_P2: tl.constexpr):
    """(group, first row, end row) of row tile ``pid_m``; group ``E`` is the zero-filled tail past ``offs[-1]``,
    ``E + 1`` a program with no tile."""
    idx = tl.arange(0, E_P2)
    ends = tl.load(offs + idx, mask=idx < E, other=0)
    ends = tl.where(idx == E, M, ends)  # the tail group ends at M
    starts = tl.load(offs + idx - 1, mask=(idx > 0) & (idx <= E), other=0)
    counts = tl.where(idx <= E, tl.maximum(ends - starts, 0), 0)
    tiles = (counts + BM - 1) // BM
    cum = tl.cumsum(tiles, axis=0)
    g = tl.sum((cum <= pid_m).to(tl.int32), axis=0)
    first = tl.sum(tl.where(idx == g, cum - tiles, 0), axis=0)
    row0 = tl.sum(tl.where(idx == g, starts, 0), axis=0) + (pid_m - first) * BM
    row_end = tl.sum(tl.where(idx == g, ends, 0), axis=0)
    return g, row0, row_end


@triton.jit
def _grouped_kernel(a, sa, w, sw, offs, out, M, N, KC, E,
                    stride_am, stride_sam, stride_sak, stride_we, stride_bk, stride_bn, stride_swe, stride_sbk,
                    stride_sbn, stride_om, A_FP8: tl.constexpr, EVEN_K: tl.constexpr, E_P2: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    # program -> (row tile, column tile), GROUP_M row tiles side by side for L2 reuse of the weight tiles
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM) + E + 1
    tiles_n = tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    g, row0, row_end = _group_of_tile(offs, pid_m, M, E, BM, E_P2)
    if g > E:
        return
    rows = row0 + tl.arange(0, BM)
    rmask = rows < row_end
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < N
    r64 = rows.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if g < E:
        ks = tl.arange(0, BK)
        a_ptrs = a + r64[:, None] * stride_am + ks[None, :]
        w_base = w + g.to(tl.int64) * stride_we
        b_ptrs = w_base + ks[:, None].to(tl.int64) * stride_bk + cols[None, :].to(tl.int64) * stride_bn
        sw_ptrs = sw + g.to(tl.int64) * stride_swe + (cols // BK) * stride_sbn
        for kb in range(0, tl.cdiv(KC, BK)):
            if EVEN_K:
                av = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
                bv = tl.load(b_ptrs, mask=cmask[None, :], other=0.0)
            else:
                kmask = kb * BK + ks < KC
                av = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
                bv = tl.load(b_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
            sb = tl.load(sw_ptrs + kb * stride_sbk, mask=cmask, other=0.0)
            if A_FP8:
                part = tl.dot(av, bv)
                sav = tl.load(sa + r64 * stride_sam + kb * stride_sak, mask=rmask, other=0.0)
                acc += part * (sav[:, None] * sb[None, :])
            else:
                part = tl.dot(av, bv.to(av.dtype))
                acc += part * sb[None, :]
            a_ptrs += BK
            b_ptrs += BK * stride_bk
    o_ptrs = out + r64[:, None] * stride_om + cols[None, :]
    tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def _configs(a_fp8: bool) -> list:
    if a_fp8:
        shapes = [(128, 128, 8, 4), (128, 256, 8, 3), (64, 128, 4, 4), (128, 128, 4, 4)]
    else:
        shapes = [(128, 128, 8, 3), (128, 256, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4)]
    return [triton.Config({"BM": bm, "BN": bn, "GROUP_M": 8}, num_warps=nw, num_stages=ns) for bm, bn, nw, ns in shapes]


_TUNED = {flag: triton.autotune(configs=_configs(flag), key=["N", "KC", "E"])(_grouped_kernel)
          for flag in (False, True)}


def grouped_mm_triton(a: Tensor, a_scale: Tensor | None, weight: Tensor, scale: Tensor, offs: Tensor,
                      trans: bool = False, out_dtype: torch.dtype = torch.bfloat16,
                      out: Tensor | None = None) -> Tensor:
    """The grouped GEMM kernel on prepared operands.

    Args:
        a: ``[M, C]`` e4m3 with ``a_scale [M, ceil(C/128)]`` (its 1x128 scales), or bf16 / fp16 with ``a_scale``
            None (W8A16). ``C`` is the contraction: ``K`` (``trans=False``) or ``N`` (``trans=True``).
        weight: ``[E, N, K]`` e4m3. scale: ``[E, ceil(N/128), ceil(K/128)]`` fp32. offs: ``[E]`` int32 row ends.

    Returns:
        ``[M, N]`` (``trans=False``) or ``[M, K]`` (``trans=True``) in ``out_dtype`` (into ``out`` if given); rows
        past ``offs[-1]`` zero.
    """
    m, c = a.shape
    e, n_w, k_w = weight.shape
    n_out = k_w if trans else n_w
    if a.stride(-1) != 1:
        a = a.contiguous()
    weight, scale = weight.contiguous(), scale.contiguous()
    if out is None:
        out = torch.empty((m, n_out), dtype=out_dtype, device=a.device)
    if m == 0 or n_out == 0:
        return out
    a_fp8 = a_scale is not None
    sa = a_scale if a_fp8 else scale  # unused when not a_fp8
    if trans:  # contraction along W's rows
        sbk, sbn, ssk, ssn = weight.stride(1), weight.stride(2), scale.stride(1), scale.stride(2)
    else:
        sbk, sbn, ssk, ssn = weight.stride(2), weight.stride(1), scale.stride(2), scale.stride(1)
    sam, sak = (sa.stride(0), sa.stride(1)) if a_fp8 else (0, 0)
    args = (a, sa, weight, scale, offs, out, m, n_out, c, e, a.stride(0), sam, sak, weight.stride(0),
            sbk, sbn, scale.stride(0), ssk, ssn, out.stride(0))
    consts = dict(A_FP8=a_fp8, EVEN_K=c % BLOCK == 0, E_P2=triton.next_power_of_2(e + 2), BK=BLOCK)
    if interpreting():
        bm, bn = 16, 32
        grid = ((triton.cdiv(m, bm) + e + 1) * triton.cdiv(n_out, bn),)
        _grouped_kernel[grid](*args, **consts, BM=bm, BN=bn, GROUP_M=2)
    else:
        def grid(meta):
            return ((triton.cdiv(m, meta["BM"]) + e + 1) * triton.cdiv(n_out, meta["BN"]),)
        _TUNED[a_fp8][grid](*args, **consts)
    return out


@triton.jit
def _low_rank_add_kernel(out, v, w, offs, M, N, E, R, scale, stride_om, stride_vm, stride_we, stride_wn,
                         E_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    g, row0, row_end = _group_of_tile(offs, tl.program_id(0), M, E, BM, E_P2)
    if g >= E:  # rows past offs[-1] (or no tile): left as they are
        return
    rows = row0 + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BR)
    rmask, cmask, kmask = rows < row_end, cols < N, ks < R
    r64 = rows.to(tl.int64)
    vt = tl.load(v + r64[:, None] * stride_vm + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    wt = tl.load(w + g.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                 mask=kmask[:, None] & cmask[None, :], other=0.0)
    mask = rmask[:, None] & cmask[None, :]
    ptrs = out + r64[:, None] * stride_om + cols[None, :]
    acc = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + scale * tl.dot(vt, wt, input_precision="ieee")
    tl.store(ptrs, acc.to(out.dtype.element_ty), mask=mask)


def low_rank_add_triton(out: Tensor, v: Tensor, w: Tensor, scale: float, offs: Tensor) -> Tensor:
    """``out [M, N] += scale * v[rows of e] @ w[e]^T`` in place, one pass over ``out`` (read, the fp32 sum, one
    rounding, written; rows past ``offs[-1]`` untouched; fp32 operands multiplied exactly, not in TF32), ``v [M, R]``
    and ``w [E, N, R]`` in ``out``'s dtype: the low-rank term of a grouped GEMM whose kernel does not take it
    (``grouped_mm``, the weight-only and Triton FP8 kernels). A product written by a grouped GEMM and then added
    would be four passes over ``[M, N]``."""
    m, n = out.shape
    e, r = w.shape[0], w.shape[2]
    if m == 0 or n == 0:
        return out
    v, w = v.contiguous(), w.contiguous()
    bm, bn = (16, 32) if interpreting() else (64, 128)
    br = max(16, triton.next_power_of_2(r))
    e_p2 = triton.next_power_of_2(e + 2)
    grid = (triton.cdiv(m, bm) + e + 1, triton.cdiv(n, bn))
    _low_rank_add_kernel[grid](out, v, w, offs, m, n, e, r, float(scale), out.stride(0), v.stride(0), w.stride(0),
                               w.stride(1), E_P2=e_p2, BM=bm, BN=bn, BR=br, num_warps=4)
    return out


@triton.jit
def transpose_codes_kernel(src, dst, R, C, stride_se, stride_de, BT: tl.constexpr):
    """``dst[e, c, r] = src[e, r, c]`` for one ``[BT, BT]`` tile of matrix ``e`` (bytes; rows contiguous in both):
    read and written along rows in 16-byte accesses, transposed through shared memory."""
    e = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BT + tl.arange(0, BT)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    tile = tl.load(src + e * stride_se + rows[:, None].to(tl.int64) * C + cols[None, :], mask=mask)
    tl.store(dst + e * stride_de + cols[:, None].to(tl.int64) * R + rows[None, :], tl.trans(tile), mask=tl.trans(mask))


def transpose_codes_triton(codes: Tensor) -> Tensor:
    """``codes [E, R, C]`` (1-byte elements) -> ``[E, C, R]`` contiguous, the same dtype: one pass, a ``[64, 64]``
    tile a program (torch's transposing copy of 1-byte elements reads ~180 GB/s on the H200)."""
    e, r, c = codes.shape
    src = codes.contiguous().view(torch.uint8)
    dst = torch.empty((e, c, r), dtype=torch.uint8, device=codes.device)
    if dst.numel():
        grid = (triton.cdiv(r, 64), triton.cdiv(c, 64), e)
        transpose_codes_kernel[grid](src, dst, r, c, r * c, r * c, BT=64, num_warps=4)
    return dst.view(codes.dtype)
