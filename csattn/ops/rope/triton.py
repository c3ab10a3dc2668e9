"""Fused per-head RMSNorm + RoPE (the query heads) and plain RoPE (the inverse rotation of the attention
output), forward and backward, in Triton.

Why: in PyTorch the query path ``q_b_proj -> RMSNorm (fp32) -> RoPE`` makes four or five full passes over
``[R, H, d]`` (casts to fp32, the square, the product, the concatenation of rotated and plain channels), and
the backward as many again; at H = 64, d = 512 those elementwise passes cost more than the attention
kernels. Here one program per (row, block of heads) reads each element once and writes it once:

- forward: ``y = rope(x * rsqrt(mean(x^2) + eps))`` in fp32, rounded once to ``x``'s dtype;
- backward: ``g' = rope^-1(dy)`` (a rotation's transpose is the opposite rotation), then the RMSNorm backward
  ``dx = r (g' - x r^2 mean(g' x))`` with ``r`` recomputed from ``x``.

The rotated channels are the trailing ``P`` of each head, in interleaved pairs ``(2i, 2i + 1)``; each program
loads its tile twice, once as is and once with the pair partners swapped (``c ^ 1``), so the rotation is
``v cos + sign v_partner sin`` with no data reshuffling in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..autograd import named_grads

__all__ = ["head_norm_rope_triton", "rope_heads_triton", "rope_heads_triton_"]

HEADS_PER_PROGRAM = 4
TAIL_HEADS_PER_PROGRAM = 16  # the in-place rotation's tile: 16 heads x the P rotated channels


@triton.jit
def _rope_tables(cos, sin, row, stride_c, ch, D: tl.constexpr, P: tl.constexpr):
    """cos / sin per channel (1 / 0 on the unrotated channels and on the padding past ``D``, whose table
    entries do not exist) and the pair sign (-1 even, +1 odd)."""
    is_rope = (ch >= D - P) & (ch < D)
    pair = tl.where(is_rope, (ch - (D - P)) // 2, 0)
    c = tl.load(cos + row * stride_c + pair, mask=is_rope, other=1.0).to(tl.float32)
    s = tl.load(sin + row * stride_c + pair, mask=is_rope, other=0.0).to(tl.float32)
    sign = tl.where(ch % 2 == 0, -1.0, 1.0)
    return c, s, sign


@triton.jit
def _head_tile(stride_xr, H, D: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, C0: tl.constexpr):
    """This program's row, the offsets of its ``[BH, BD]`` block of heads x channels ``C0..``, channels, and mask."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    ch = C0 + tl.arange(0, BD)
    mask = (heads[:, None] < H) & (ch[None, :] < D)
    return row, row * stride_xr + heads[:, None] * D, ch, mask


@triton.jit
def _load_with_pair(x, base, ch, mask):
    """The tile in fp32 and the same tile with each channel swapped for its rotation partner (``ch ^ 1``)."""
    v = tl.load(x + base + ch[None, :], mask=mask, other=0.0).to(tl.float32)
    pv = tl.load(x + base + (ch ^ 1)[None, :], mask=mask, other=0.0).to(tl.float32)
    return v, pv


@triton.jit
def _rotate(v, pv, cos, sin, row, stride_c, ch, D: tl.constexpr, P: tl.constexpr, INVERSE: tl.constexpr):
    """The tile rotated (by the negative angle with ``INVERSE``) from itself and its pair-swapped copy."""
    c, s, sign = _rope_tables(cos, sin, row, stride_c, ch, D, P)
    if INVERSE:
        s = -s
    return v * c[None, :] + (sign * s)[None, :] * pv


@triton.jit
def head_rope_fwd_kernel(x, cos, sin, y, stride_xr, stride_c, eps, H,
                         D: tl.constexpr, P: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
                         NORM: tl.constexpr, INVERSE: tl.constexpr):
    row, base, ch, mask = _head_tile(stride_xr, H, D, BH, BD, 0)
    v, pv = _load_with_pair(x, base, ch, mask)
    if NORM:
        rs = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
        v = v * rs[:, None]
        pv = pv * rs[:, None]
    out = _rotate(v, pv, cos, sin, row, stride_c, ch, D, P, INVERSE)
    tl.store(y + base + ch[None, :], out.to(y.dtype.element_ty), mask=mask)


@triton.jit
def head_norm_rope_bwd_kernel(x, dy, cos, sin, dx, stride_xr, stride_c, eps, H,
                              D: tl.constexpr, P: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    row, base, ch, mask = _head_tile(stride_xr, H, D, BH, BD, 0)
    g, pg = _load_with_pair(dy, base, ch, mask)
    gn = _rotate(g, pg, cos, sin, row, stride_c, ch, D, P, True)  # the inverse rotation of the gradient
    v = tl.load(x + base + ch[None, :], mask=mask, other=0.0).to(tl.float32)
    rs = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
    dot = tl.sum(gn * v, axis=1) / D
    out = rs[:, None] * (gn - v * (rs * rs * dot)[:, None])
    tl.store(dx + base + ch[None, :], out.to(dx.dtype.element_ty), mask=mask)


@triton.jit
def rope_tail_kernel(x, cos, sin, stride_xr, stride_c, H, D: tl.constexpr, P: tl.constexpr, BH: tl.constexpr,
                     BP: tl.constexpr, INVERSE: tl.constexpr):
    """Rotate the trailing ``P`` channels of ``[BH]`` heads of one row in place (the others are not touched):
    each program reads its elements and their pair partners before it writes them, and no two programs share one."""
    row, base, ch, mask = _head_tile(stride_xr, H, D, BH, BP, D - P)
    v, pv = _load_with_pair(x, base, ch, mask)
    out = _rotate(v, pv, cos, sin, row, stride_c, ch, D, P, INVERSE)
    tl.store(x + base + ch[None, :], out.to(x.dtype.element_ty), mask=mask)


def _launch_fwd(x: Tensor, cos: Tensor, sin: Tensor, eps: float, norm: bool, inverse: bool) -> Tensor:
    rows, heads, dim = x.shape
    y = torch.empty_like(x)
    if rows:
        grid = (rows, triton.cdiv(heads, HEADS_PER_PROGRAM))
        head_rope_fwd_kernel[grid](x, cos, sin, y, x.stride(0), cos.stride(0), eps, heads, D=dim,
                                   P=2 * cos.shape[1], BH=HEADS_PER_PROGRAM, BD=triton.next_power_of_2(dim),
                                   NORM=norm, INVERSE=inverse, num_warps=4)
    return y


class _HeadNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
        ctx.save_for_backward(x, cos, sin)
        ctx.eps = eps
        return _launch_fwd(x, cos, sin, eps, norm=True, inverse=False)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, cos, sin = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        rows, heads, dim = x.shape
        if rows:
            grid = (rows, triton.cdiv(heads, HEADS_PER_PROGRAM))
            head_norm_rope_bwd_kernel[grid](x, dy, cos, sin, dx, x.stride(0), cos.stride(0), ctx.eps, heads, D=dim,
                                            P=2 * cos.shape[1], BH=HEADS_PER_PROGRAM,
                                            BD=triton.next_power_of_2(dim), num_warps=4)
        return _HeadNormRopeGrads(x=dx)


_HeadNormRopeGrads = named_grads(_HeadNormRope)


class _RopeHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.inverse = inverse
        return _launch_fwd(x, cos, sin, 0.0, norm=False, inverse=inverse)

    @staticmethod
    def backward(ctx, dy: Tensor):
        cos, sin = ctx.saved_tensors
        return _RopeHeadsGrads(x=_launch_fwd(dy.contiguous(), cos, sin, 0.0, norm=False, inverse=not ctx.inverse))


_RopeHeadsGrads = named_grads(_RopeHeads)


def _check(x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if x.dim() != 3:
        raise ValueError(f"x must be [R, H, d], got shape {tuple(x.shape)}")
    rows, _, dim = x.shape
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != rows:
        raise ValueError(f"cos and sin must be [R={rows}, P/2], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    p = 2 * cos.shape[1]
    if p > dim or (dim - p) % 2:
        raise ValueError(f"{p} rope channels do not fit the head dim {dim} as whole pairs")
    return x.contiguous(), cos.contiguous(), sin.contiguous()


def head_norm_rope_triton(x: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
    """``rope(rmsnorm(x))`` per head (RMSNorm without weight), differentiable in ``x``.

    Args:
        x: ``[R, H, d]`` (bf16 / fp16 / fp32). cos, sin: ``[R, P/2]`` RoPE tables of the rows (fp32).
        eps: RMSNorm epsilon.

    Returns:
        ``[R, H, d]`` in ``x``'s dtype; the trailing ``P`` channels of every head rotated in interleaved pairs.
    """
    x, cos, sin = _check(x, cos, sin)
    return _HeadNormRope.apply(x, cos, sin, float(eps))


def rope_heads_triton(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """``apply_rope(x, cos, sin, inverse)`` for ``x [R, H, d]``, differentiable in ``x``."""
    x, cos, sin = _check(x, cos, sin)
    return _RopeHeads.apply(x, cos, sin, bool(inverse))


def rope_heads_triton_(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """``x = apply_rope(x, cos, sin, inverse)`` in place, outside autograd: only the trailing ``P`` channels of
    each head are read and written (an eighth of a head at d = 512, P = 64), where the out-of-place rotation
    copies the whole tensor. For a fresh tensor that nothing else reads (the attention output in the forward,
    its gradient in the backward).

    Args:
        x: ``[R, H, d]``, contiguous. cos, sin: ``[R, P/2]`` RoPE tables of the rows.

    Returns:
        ``x`` itself.
    """
    if not x.is_contiguous():
        raise ValueError("rope_heads_triton_ rotates in place: x must be contiguous")
    _, cos, sin = _check(x, cos, sin)
    rows, heads, dim = x.shape
    p = 2 * cos.shape[1]
    if rows and p:
        grid = (rows, triton.cdiv(heads, TAIL_HEADS_PER_PROGRAM))
        rope_tail_kernel[grid](x, cos, sin, x.stride(0), cos.stride(0), heads, D=dim, P=p,
                               BH=TAIL_HEADS_PER_PROGRAM, BP=triton.next_power_of_2(p), INVERSE=bool(inverse),
                               num_warps=4)
    return x
