"""Plain-PyTorch references for the routed experts: the per-expert loop (the tests' oracle, and the path for
dtypes ``grouped_mm`` does not take), and the elementwise pieces of the grouped path (clamped SwiGLU forward
and backward with the routing weight folded in, and the un-permute gather-sum) that the Triton kernels fuse.

The loop reads the per-expert counts on the host (``bincount(...).tolist()``): it is a reference, not a fast
path. The elementwise references read nothing on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..fp8.naive import dequantize

__all__ = ["ExpertLora", "clamped_swiglu", "experts_ref", "swiglu_fwd_ref", "swiglu_bwd_ref", "gather_sum_ref"]

# fp32 bytes per temporary per row chunk of the elementwise references (bounds their fp32 copies of [N, 2I])
CHUNK_BYTES = 64 << 20


class ExpertLora(NamedTuple):
    """A low-rank pair per expert on top of a 3-D expert weight ``W [E, out, in]``: expert ``e`` computes
    ``W[e] @ v + scale * b[e] @ (a[e] @ v)``, i.e. the weight ``W[e] + scale * b[e] @ a[e]``, never formed.

    Attributes:
        a: ``[E, r, in]``. b: ``[E, out, r]``. scale: ``alpha / r``.
    """

    a: Tensor
    b: Tensor
    scale: float

    @classmethod
    def from_peft(cls, a: Tensor, b: Tensor, experts: int, scale: float = 0.0) -> ExpertLora:
        """From PEFT's factors of a 3-D expert parameter (``target_parameters``): ``lora_A.weight [E r, in]`` (expert
        ``e``'s rows ``e r .. e r + r - 1``) and ``lora_B.weight [out, r E]`` (its columns ``j E + e``)."""
        r = a.shape[0] // experts
        return cls(a.reshape(experts, r, a.shape[1]), b.reshape(b.shape[0], r, experts).permute(2, 0, 1), scale)

    def to_peft(self) -> tuple[Tensor, Tensor]:
        """PEFT's ``(lora_A.weight [E r, in], lora_B.weight [out, r E])``: the inverse of :meth:`from_peft`."""
        e, r, inp = self.a.shape
        return self.a.reshape(e * r, inp), self.b.permute(1, 2, 0).reshape(self.b.shape[1], r * e)


def lora_linear(v: Tensor, weight: Tensor, lora: ExpertLora | None, e: int) -> Tensor:
    """``v @ weight^T`` plus expert ``e``'s low-rank term (``weight``: that expert's ``[out, in]``)."""
    y = F.linear(v, weight)
    if lora is None:
        return y
    return y + lora.scale * F.linear(F.linear(v, lora.a[e]), lora.b[e])


def clamped_swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` (same shapes in, same shape out)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def experts_ref(x: Tensor, experts: Tensor, weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor,
                limit: float, gate_up_lora: ExpertLora | None = None, down_lora: ExpertLora | None = None,
                gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None) -> Tensor:
    """Routed experts by a Python loop over experts (plain autograd).

    Args:
        x: ``[T, D]``. experts: ``[T, k]`` int64 expert ids. weights: ``[T, k]`` routing weights.
        gate_up_proj: ``[E, 2I, D]`` (gate rows first). down_proj: ``[E, D, I]``. limit: SwiGLU clamp.
        gate_up_lora, down_lora: optional low-rank terms on the two weights (:class:`ExpertLora`, ``a [E, r, D]``
            ``b [E, 2I, r]`` and ``a [E, r, I]`` ``b [E, D, r]``).
        gate_up_scale, down_scale: for frozen FP8 weights (e4m3), their 128x128 block scales; each expert's
            weights are dequantized to ``x``'s dtype when its rows come up (never all experts at once).

    Returns:
        ``[T, D]``: ``sum_j weights[t, j] * down[e_j] @ swiglu(gate_up[e_j] @ x[t])``.
    """
    num_experts, k = gate_up_proj.shape[0], experts.shape[-1]
    flat_expert = experts.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)  # assignments grouped by expert
    counts = torch.bincount(flat_expert, minlength=num_experts).tolist()  # host read: reference only
    token = order // k
    w = weights.reshape(-1)[order]
    # the k weighted expert outputs of a row summed in fp32 (at least) and rounded once, as the grouped paths do:
    # a bf16 / fp16 index_add rounds at every add, and its backward would round the incoming gradient to x's
    # dtype before the routing weight scales it (a second rounding, and fp16 underflow, in the weights' gradients)
    out = torch.zeros(x.shape, dtype=_compute_dtype(x.dtype), device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = token[start:start + count]
        gate, up = lora_linear(x[rows], _expert(gate_up_proj, gate_up_scale, e, x.dtype), gate_up_lora,
                               e).chunk(2, dim=-1)
        y = lora_linear(clamped_swiglu(gate, up, limit), _expert(down_proj, down_scale, e, x.dtype), down_lora, e)
        out = out.index_add(0, rows, (y * w[start:start + count, None]).to(out.dtype))
        start += count
    return out.to(x.dtype)


def _expert(weight: Tensor, scale: Tensor | None, e: int, dtype: torch.dtype) -> Tensor:
    """Expert ``e``'s weight, dequantized to ``dtype`` if ``scale`` (its FP8 block scales) is given."""
    return weight[e] if scale is None else dequantize(weight[e], scale[e], dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _row_step(cols: int) -> int:
    return max(1, CHUNK_BYTES // (4 * max(cols, 1)))


def _swiglu_parts(g: Tensor, u: Tensor, limit: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The clamped gate, clamped up, sigmoid, silu and activation; one formula for the forward and the
    backward's recomputation, so the recomputed activation is bit-equal to the forward's."""
    gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    s = torch.sigmoid(gc)
    silu = gc * s
    return gc, uc, s, silu, silu * uc


def swiglu_fwd_ref(gu: Tensor, w: Tensor, limit: float, out: Tensor | None = None) -> Tensor:
    """Weighted clamped SwiGLU of the gate/up GEMM output.

    Args:
        gu: ``[N, 2I]`` (gate columns first). w: ``[N]`` routing weight of each row. limit: the clamp.
        out: optional ``[N, I]`` destination (``gu.dtype``).

    Returns:
        ``[N, I]`` ``silu(min(g, L)) * clamp(u, -L, L) * w`` in fp32 (fp64 for fp64), rounded once to ``gu.dtype``.
    """
    n, inter = gu.shape[0], gu.shape[1] // 2
    c = _compute_dtype(gu.dtype)
    out = torch.empty((n, inter), dtype=gu.dtype, device=gu.device) if out is None else out
    step = _row_step(2 * inter)
    for lo in range(0, n, step):
        g, u = gu[lo:lo + step].to(c).chunk(2, dim=-1)
        act = _swiglu_parts(g, u, limit)[-1]
        out[lo:lo + step] = (act * w[lo:lo + step, None].to(c)).to(out.dtype)
    return out


def swiglu_bwd_ref(gu: Tensor, w: Tensor, dh: Tensor, limit: float) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`swiglu_fwd_ref`, recomputing the activation from ``gu``.

    Args:
        gu: ``[N, 2I]`` saved gate/up GEMM output. w: ``[N]``. dh: ``[N, I]`` gradient of the weighted output.

    Returns:
        ``dgu [N, 2I]`` (``gu.dtype``); ``h [N, I]``, the weighted forward output recomputed (``gu.dtype``,
        bit-equal to the forward's; the down-projection weight gradient needs it); ``dw [N]`` in fp32 (fp64 for
        fp64): ``sum_i dh * swiglu``.
    """
    n, inter = gu.shape[0], gu.shape[1] // 2
    c = _compute_dtype(gu.dtype)
    dgu = torch.empty_like(gu)
    h = torch.empty((n, inter), dtype=gu.dtype, device=gu.device)
    dw = torch.empty((n,), dtype=c, device=gu.device)
    step = _row_step(2 * inter)
    for lo in range(0, n, step):
        g, u = gu[lo:lo + step].to(c).chunk(2, dim=-1)
        wr = w[lo:lo + step, None].to(c)
        gc, uc, s, silu, act = _swiglu_parts(g, u, limit)
        h[lo:lo + step] = (act * wr).to(h.dtype)
        d = dh[lo:lo + step].to(c)
        dw[lo:lo + step] = (d * act).sum(-1)
        d = d * wr
        # clamp passes the gradient where the input lies inside the closed interval (as torch.clamp does)
        dg = d * uc * (s * (1 + gc * (1 - s))) * (g <= limit)
        du = d * silu * ((u >= -limit) & (u <= limit))
        dgu[lo:lo + step] = torch.cat((dg, du), dim=-1).to(dgu.dtype)
    return dgu, h, dw


def gather_sum_ref(src: Tensor, inv: Tensor, k: int, out: Tensor | None = None) -> Tensor:
    """Un-permute and sum the ``k`` picks of every token.

    Args:
        src: ``[N, D]`` rows in expert order, ``N = T * k``. inv: ``[N]`` int64: row of ``src`` holding pick
            ``j`` of token ``t`` at ``t * k + j``. out: optional ``[T, D]`` destination.

    Returns:
        ``[T, D]`` ``out[t] = sum_j src[inv[t * k + j]]``, summed in fp32 (fp64 for fp64), in ``src.dtype``.
    """
    t = inv.shape[0] // max(k, 1)
    out = torch.empty((t, src.shape[1]), dtype=src.dtype, device=src.device) if out is None else out
    c = _compute_dtype(src.dtype)
    step = max(1, _row_step(src.shape[1]) // max(k, 1))
    for lo in range(0, t, step):
        idx = inv[lo * k:(lo + step) * k]
        out[lo:lo + step] = src.index_select(0, idx).to(c).view(-1, k, src.shape[1]).sum(1).to(out.dtype)
    return out
