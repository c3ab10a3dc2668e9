"""The MoE's SwiGLU backward in the epilogue of the Gluon kernel (:mod:`.gluon`) that makes its input, the down
projection's input gradient ``dh = dY W_e``: each math warpgroup's ``[64, 128]`` block of ``dh`` (fp32, rounded to
``gu``'s dtype as the plain kernel would store it) meets the same block of ``gu``'s gate and up halves, and the
epilogue writes ``dgu`` quantized per 1x128 tile (the gate_up input gradient's operand: a column tile of ``dh`` is one
quantization tile of each half) and the row sums of ``dw`` per column tile. ``dh`` itself is never written, and the
separate SwiGLU pass that read it back (with ``gu``) is gone: on an H100 (0ab281f, 16k tokens, 256 experts top-6) that
pass took 0.81 ms of the frozen MoE's 16.9 ms of kernels (``lab/results/finetune_h100/moe_profile_0ab281f.txt``).

The arithmetic is ``csattn.ops.moe.triton._swiglu_bwd_kernel``'s with ``quantize_tile``'s (IEEE divisions, the
e4m3 conversion rounding to nearest even), so ``dgu``'s codes and scales are that kernel's; the row sums of ``dw`` add
a tile's 128 products in another order (last bits).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .gluon_tiles import BN, _cta_sync
from .naive import FP8_MAX

__all__ = ["SwigluGrad"]

_FP8_MAX = gl.constexpr(FP8_MAX)


class SwigluGrad(NamedTuple):
    """The epilogue's operands: ``gu [M, 2I]`` (the saved gate / up output), ``w [M]`` (the routing weights), and its
    outputs ``q [M, 2I]`` e4m3 with ``s [M, 2I / 128]`` fp32 (``dgu`` quantized per 1x128 tile), ``dwp [M, I / 128]``
    fp32 (``dw``'s row sums per column tile); ``limit`` the SwiGLU's clamp."""

    gu: Tensor
    w: Tensor
    q: Tensor
    s: Tensor
    dwp: Tensor
    limit: float


@gluon.constexpr_function
def chunk_layout():
    """Register layout of a ``[16, BN]`` chunk of the epilogue: 8 consecutive columns a thread (16-byte loads of
    ``gu``), a row within half a warp (the row reductions stay in the warp), 16 elements a thread."""
    return gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])


@gluon.constexpr_function
def staging_layout():
    """Shared layout of the ``[64, BN]`` block of ``dh`` staged between the accumulator's layout and the chunks'."""
    return gl.SwizzledSharedLayout(8, 1, 8, [1, 0])


@gluon.jit
def _quantized_store(v, q_ptrs, s_ptrs, mask, rmask):
    """``v [16, BN]`` (a row's 1x128 tile each) quantized as ``quantize_tile``: codes to ``q_ptrs``, scales to
    ``s_ptrs``."""
    amax = gl.max(gl.abs(v), axis=1)
    scale = gl.where(amax == 0.0, 1.0, gl.div_rn(amax, gl.full_like(amax, _FP8_MAX)))
    q = gl.div_rn(v, gl.expand_dims(scale, 1))
    q = gl.minimum(gl.maximum(q, -_FP8_MAX), _FP8_MAX)
    gl.store(q_ptrs, q.to(gl.float8e4nv), mask=mask)
    gl.store(s_ptrs, scale, mask=rmask)


@gluon.jit
def swiglu_bwd_store(acc, first_row, row_end, pid_n, tiles_n, staging, ep):
    """A math warpgroup's ``[64, BN]`` block of ``dh`` (``acc``, fp32; rows ``first_row + [0, 64)`` below
    ``row_end``, columns of column tile ``pid_n``) through the weighted clamped SwiGLU's backward: ``dgu``'s gate and
    up blocks quantized, and ``dw``'s row sums over the block into column ``pid_n`` of ``dwp``. The block goes
    through ``staging`` (``[64, BN]`` shared, the warpgroup's own) in ``gu``'s dtype, as the plain kernel stores it,
    and comes back 16 rows at a time (held whole in fp32 beside ``gu``'s blocks it spilled: 1-4 KB a thread).
    ``ep``: (gu, w, q, s, dwp, stride_gu, stride_q, stride_s, stride_dwp, limit)."""
    gu, w, q, s, dwp, stride_gu, stride_q, stride_s, stride_dwp, limit = ep
    CH: gl.constexpr = chunk_layout()
    dt: gl.constexpr = gu.dtype.element_ty
    inter = tiles_n * BN
    _cta_sync()  # the warpgroup's reads of the last block are done
    staging.store(acc.to(dt))
    _cta_sync()
    cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, CH))
    for c in gl.static_range(4):
        rows = first_row + c * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, CH))
        rmask = rows < row_end
        mask = gl.expand_dims(rmask, 1) & gl.expand_dims(cols < inter, 0)
        r64 = rows.to(gl.int64)
        at = gl.expand_dims(r64 * stride_gu, 1) + gl.expand_dims(cols, 0)
        d = staging.slice(c * 16, 16, dim=0).load(CH).to(gl.float32)
        g = gl.load(gu + at, mask=mask, other=0.0).to(gl.float32)
        u = gl.load(gu + at + inter, mask=mask, other=0.0).to(gl.float32)
        wr = gl.load(w + rows, mask=rmask, other=0.0).to(gl.float32)
        gc = gl.minimum(g, limit)
        uc = gl.minimum(gl.maximum(u, -limit), limit)
        sg = 1 / (1 + gl.exp(-gc))  # tl.sigmoid's formula
        silu = gc * sg
        gl.store(dwp + r64 * stride_dwp + pid_n, gl.sum(d * (silu * uc), axis=1), mask=rmask)
        d = d * gl.expand_dims(wr, 1)
        # clamp passes the gradient inside the closed interval, as torch.clamp's backward does
        dg = gl.where(g <= limit, d * uc * (sg * (1 + gc * (1 - sg))), 0.0).to(dt).to(gl.float32)
        du = gl.where((u >= -limit) & (u <= limit), d * silu, 0.0).to(dt).to(gl.float32)
        q_at = q + gl.expand_dims(r64 * stride_q, 1) + gl.expand_dims(cols, 0)
        s_at = s + r64 * stride_s + pid_n
        _quantized_store(dg, q_at, s_at, mask, rmask)
        _quantized_store(du, q_at + inter, s_at + tiles_n, mask, rmask)
