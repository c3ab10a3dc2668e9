"""Triton kernels of the grouped MoE path: the weighted clamped SwiGLU (forward, and backward with the activation
recomputed from the saved gate/up GEMM output) and the un-permute gather-sum.

Why: in PyTorch the SwiGLU on ``[N, 2I]`` makes a pass per op (casts to fp32, two clamps, sigmoid, three
products, the weight, the cast back; about twice as many in the backward, plus a concatenation of the gate and
up gradients); here each element of ``gu`` is read once and each output written once. The gather-sum reads
the ``k`` rows of every token and sums them in fp32 registers: no atomics (so the result is deterministic and
rounded once, unlike a bf16 ``index_add_``) and no ``[T, k, D]`` temporary.

Same math as :mod:`csattn.ops.moe.naive` (``swiglu_fwd_ref``, ``swiglu_bwd_ref``, ``gather_sum_ref``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["swiglu_fwd_triton", "swiglu_bwd_triton", "gather_sum_triton"]

BLOCK_ROWS = 16
BLOCK_COLS = 128


@triton.jit
def _swiglu_parts(g, u, limit):
    """Clamped up, sigmoid of the clamped gate, silu, activation (one formula for forward and recompute)."""
    gc = tl.minimum(g, limit)
    uc = tl.minimum(tl.maximum(u, -limit), limit)
    s = tl.sigmoid(gc)
    silu = gc * s
    return gc, uc, s, silu, silu * uc


@triton.jit
def _swiglu_fwd_kernel(gu, w, h, N, I, stride_gu, stride_h, limit,
                       BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = rows < N
    mask = rmask[:, None] & (cols < I)[None, :]
    base = rows.to(tl.int64)[:, None] * stride_gu + cols[None, :]
    g = tl.load(gu + base, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu + base + I, mask=mask, other=0.0).to(tl.float32)
    wr = tl.load(w + rows, mask=rmask, other=0.0).to(tl.float32)
    _, _, _, _, act = _swiglu_parts(g, u, limit)
    out = act * wr[:, None]
    tl.store(h + rows.to(tl.int64)[:, None] * stride_h + cols[None, :], out.to(h.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(gu, w, dh, dgu, h, dw, N, I, stride_gu, stride_dh, stride_dgu, stride_h, limit,
                       BM: tl.constexpr, BN: tl.constexpr):
    # one program per block of rows, looping over the columns: dw is a row sum over all I columns
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < N
    r64 = rows.to(tl.int64)[:, None]
    wr = tl.load(w + rows, mask=rmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BM], dtype=tl.float32)
    for c0 in range(0, I, BN):
        cols = c0 + tl.arange(0, BN)
        mask = rmask[:, None] & (cols < I)[None, :]
        base = r64 * stride_gu + cols[None, :]
        g = tl.load(gu + base, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu + base + I, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(dh + r64 * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gc, uc, s, silu, act = _swiglu_parts(g, u, limit)
        tl.store(h + r64 * stride_h + cols[None, :], (act * wr[:, None]).to(h.dtype.element_ty), mask=mask)
        acc += tl.sum(d * act, axis=1)
        d = d * wr[:, None]
        # clamp passes the gradient inside the closed interval, as torch.clamp's backward does
        dg = tl.where(g <= limit, d * uc * (s * (1 + gc * (1 - s))), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), d * silu, 0.0)
        out = r64 * stride_dgu + cols[None, :]
        tl.store(dgu + out, dg.to(dgu.dtype.element_ty), mask=mask)
        tl.store(dgu + out + I, du.to(dgu.dtype.element_ty), mask=mask)
    tl.store(dw + rows, acc, mask=rmask)


@triton.jit
def _gather_sum_kernel(src, inv, out, T, D, stride_src, stride_out,
                       K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    toks = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    tmask = toks < T
    mask = tmask[:, None] & (cols < D)[None, :]
    t64 = toks.to(tl.int64)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(inv + t64 * K + j, mask=tmask, other=0).to(tl.int64)
        acc += tl.load(src + row[:, None] * stride_src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out + t64[:, None] * stride_out + cols[None, :], acc.to(out.dtype.element_ty), mask=mask)


def _check_rows(t: Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(-1) != 1:
        raise ValueError(f"{name} must be 2-D with unit column stride, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")


def swiglu_fwd_triton(gu: Tensor, w: Tensor, limit: float, out: Tensor | None = None) -> Tensor:
    """Triton :func:`~csattn.ops.moe.naive.swiglu_fwd_ref`: ``gu [N, 2I]``, ``w [N]`` -> ``[N, I]``."""
    _check_rows(gu, "gu")
    n, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty((n, inter), dtype=gu.dtype, device=gu.device) if out is None else out
    _check_rows(out, "out")
    if n and inter:
        grid = (triton.cdiv(n, BLOCK_ROWS), triton.cdiv(inter, BLOCK_COLS))
        _swiglu_fwd_kernel[grid](gu, w.contiguous(), out, n, inter, gu.stride(0), out.stride(0), float(limit),
                                 BM=BLOCK_ROWS, BN=BLOCK_COLS)
    return out


def swiglu_bwd_triton(gu: Tensor, w: Tensor, dh: Tensor, limit: float,
                      out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Triton :func:`~csattn.ops.moe.naive.swiglu_bwd_ref`: ``gu [N, 2I]``, ``w [N]``, ``dh [N, I]`` ->
    ``dgu [N, 2I]``, ``h [N, I]`` (weighted, recomputed), ``dw [N]`` fp32. ``out`` optionally gives the three
    destinations."""
    _check_rows(gu, "gu")
    dh = dh if dh.stride(-1) == 1 else dh.contiguous()
    n, inter = gu.shape[0], gu.shape[1] // 2
    if out is None:
        dgu = torch.empty_like(gu, memory_format=torch.contiguous_format)
        h = torch.empty((n, inter), dtype=gu.dtype, device=gu.device)
        dw = torch.empty((n,), dtype=torch.float32, device=gu.device)
    else:
        dgu, h, dw = out
    _check_rows(dgu, "dgu")
    _check_rows(h, "h")
    if n:
        if not inter:
            dw.zero_()
        else:
            _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK_ROWS),)](
                gu, w.contiguous(), dh, dgu, h, dw, n, inter, gu.stride(0), dh.stride(0), dgu.stride(0),
                h.stride(0), float(limit), BM=BLOCK_ROWS, BN=BLOCK_COLS)
    return dgu, h, dw


def gather_sum_triton(src: Tensor, inv: Tensor, k: int, out: Tensor | None = None) -> Tensor:
    """Triton :func:`~csattn.ops.moe.naive.gather_sum_ref`: ``src [N, D]``, ``inv [N]`` -> ``[N / k, D]``."""
    _check_rows(src, "src")
    t, d = inv.shape[0] // max(k, 1), src.shape[1]
    out = torch.empty((t, d), dtype=src.dtype, device=src.device) if out is None else out
    _check_rows(out, "out")
    if t and d:
        bd = min(256, triton.next_power_of_2(d))
        grid = (triton.cdiv(t, 8), triton.cdiv(d, bd))
        _gather_sum_kernel[grid](src, inv.contiguous(), out, t, d, src.stride(0), out.stride(0),
                                 K=k, BT=8, BD=bd)
    return out
