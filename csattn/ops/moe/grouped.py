"""Routed experts with the tokens permuted once by expert and two grouped GEMMs, forward and backward, with no
host read of device data.

Forward (``N = T * k`` assignments, ``offs`` the int32 cumulative end of each expert's rows):

1. ``order = argsort(experts.flatten(), stable)``; ``token = order // k``; ``inv[order] = arange(N)``;
   ``offs[e] = #{assignments with expert <= e}`` by ``searchsorted`` on the sorted ids (on the device: no
   ``bincount``, whose CUDA kernel reads the maximum id on the host, no ``.tolist()``);
2. ``gu = grouped_mm(x[token], gate_up_proj^T, offs)`` ``[N, 2I]``;
3. ``h = swiglu(gu) * w`` ``[N, I]``, ``w`` the routing weight of each sorted assignment;
4. ``y = grouped_mm(h, down_proj^T, offs)`` ``[N, D]``;
5. ``out[t] = sum_j y[inv[t k + j]]`` (fp32 sum, one rounding).

The routing weight is folded into ``h`` rather than applied to ``y`` in the un-permute: the SwiGLU pass writes
``h`` anyway, so the product is free there, while on ``y`` it would be another pass over ``[N, D]`` (D > I);
and its gradient ``dw = sum_i dh * swiglu(gu)`` then comes from tensors the backward has in hand, whereas on
``y`` it would need ``y`` itself ``[N, D]`` saved or recomputed by a third GEMM.

Saved for the backward: ``x`` (the caller keeps it anyway: the router and shared expert save it), ``gu``, the
sorted weights and the index tensors; ``x[token]`` and the activation are recomputed.

Frozen FP8 experts: each GEMM quantizes its input per 1x128 tile, so where it does
(:func:`~csattn.ops.fp8.takes_fp8_rows`) the input comes quantized from where it is made: ``x`` and ``dout`` at
token level, written straight into expert order (:func:`~csattn.ops.fp8.quantize_1x128_rows`: k times fewer rows
quantized, a per-row quantization commutes with the gather, no bf16 rows gathered), ``h`` and ``dgu`` by the SwiGLU
kernels that write them. A separate pass would read the whole bf16 ``[N, .]`` tensor once more only to quantize it
(measured on the H200 at 256 experts top-6, 16k tokens: 2.8 ms of a 21.1 ms step for the four quantizations and the
bf16 gathers). The bf16 rows are still made where something else takes them (the LoRA products), and bit for bit the
same quantized rows result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ..autograd import named_grads
from ..backend import Backend, interpreting, use_triton
from ..backend import torch_grouped_mm as _grouped_mm
from ..fp8 import (
    BLOCK,
    FP8_DTYPE,
    Fp8Rows,
    LowRank,
    add_low_rank,
    fp8_grouped_mm,
    quantize_1x128,
    quantize_1x128_rows,
    takes_fp8_rows,
)
from .naive import ExpertLora, gather_sum_ref, swiglu_bwd_ref, swiglu_fwd_ref

__all__ = ["RoutePlan", "route_plan", "grouped_mm_supported", "grouped_experts"]

GROUPED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class RoutePlan:
    """Expert-major order of the ``N = T * k`` assignments, all on the device.

    Attributes:
        order: ``[N]`` int64, flat assignment index (``t * k + j``) of each sorted row.
        token: ``[N]`` int64, token row of each sorted row (``order // k``).
        inv: ``[N]`` int64, sorted row of each flat assignment (the inverse permutation of ``order``).
        offs: ``[E]`` int32, cumulative end of each expert's rows (``offs[-1] == N``).
    """

    order: Tensor
    token: Tensor
    inv: Tensor
    offs: Tensor


def route_plan(experts: Tensor, num_experts: int) -> RoutePlan:
    """Sort the assignments ``experts [T, k]`` (ids in ``[0, E)``) by expert, stably, without a host read."""
    k = experts.shape[-1]
    flat = experts.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    ids = torch.arange(num_experts, device=flat.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, ids, right=True, out_int32=True)
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return RoutePlan(order=order, token=torch.div(order, k, rounding_mode="floor"), inv=inv, offs=offs)


def grouped_mm_supported(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> bool:
    """Whether ``grouped_mm`` takes these operands: fp32 / bf16, one dtype and device, contiguous weights, and
    rows of D and I elements a multiple of 16 bytes (the kernels' stride alignment). Frozen FP8 weights
    (``float8_e4m3fn``) run :func:`~csattn.ops.fp8.fp8_grouped_mm` instead, which takes any fp32 / bf16 ``x [N, D]``."""
    if gate_up_proj.dtype == down_proj.dtype == FP8_DTYPE:
        return x.dim() == 2 and x.dtype in GROUPED_DTYPES
    if _grouped_mm is None or x.dim() != 2 or gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        return False
    if x.dtype not in GROUPED_DTYPES or not (x.dtype == gate_up_proj.dtype == down_proj.dtype):
        return False
    if not (x.device == gate_up_proj.device == down_proj.device):
        return False
    if not (gate_up_proj.is_contiguous() and down_proj.is_contiguous()):
        return False
    align = 16 // x.element_size()
    d, inter = down_proj.shape[1], down_proj.shape[2]
    if d % align or inter % align:
        return False
    return all(t.data_ptr() % 16 == 0 for t in (gate_up_proj, down_proj))


def _zero_empty_groups(grad: Tensor, offs: Tensor) -> Tensor:
    """Zero the weight gradients of experts without rows where the grouped kernel may leave them unwritten.

    On CPU and on sm90 the K-grouped GEMM writes zeros for an empty group; on sm100 it has been reported not
    to (pytorch/pytorch#172439). A ``where`` over the whole weight gradient costs a pass over it, so only there.
    """
    if grad.device.type == "cuda" and torch.cuda.get_device_capability(grad.device)[0] >= 10:
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        grad = grad.masked_fill((counts == 0)[:, None, None], 0)
    return grad


def _expert_mm(a: Tensor | Fp8Rows, weight: Tensor, offs: Tensor, scale: Tensor | None, compute: str,
               out_dtype: torch.dtype, trans: bool = False, low_rank: LowRank | None = None) -> Tensor:
    """Rows of each expert times ``W_e^T`` (``trans=False``) or ``W_e``, plus the LoRA term ``low_rank``:
    ``grouped_mm`` with the term added in place (:func:`~csattn.ops.fp8.add_low_rank`: the output is this op's own),
    or for a frozen FP8 weight (``scale`` its 128x128 block scales) :func:`~csattn.ops.fp8.fp8_grouped_mm` in mode
    ``compute``, on rows or on rows already quantized (:class:`~csattn.ops.fp8.Fp8Rows`, of ``out_dtype`` rows),
    which takes the term itself."""
    if scale is not None:
        return fp8_grouped_mm(a, weight, scale, offs, trans=trans, compute=compute, out_dtype=out_dtype,
                              low_rank=low_rank)
    return add_low_rank(_grouped_mm(a, weight if trans else weight.transpose(-2, -1), offs=offs), low_rank, offs)


def _takes_rows(like: Tensor, weight: Tensor, scale: Tensor | None, compute: str, trans: bool) -> bool:
    """Whether the expert GEMM quantizes its input rows (of ``like``'s dtype and device) per 1x128 tile: then the
    caller hands them over quantized, by the kernel that makes them or before the gather (see the module doc)."""
    return scale is not None and takes_fp8_rows(like.dtype, like.device, weight, compute, trans)


def _gathered_rows(v: Tensor, inv: Tensor, k: int) -> Fp8Rows:
    """``quantize_1x128(v[token])`` bit for bit (``token`` the rows in expert order, ``inv`` its inverse), quantizing
    the ``k`` times fewer rows of ``v`` (per-row tiles commute with the gather) straight into expert order: one pass
    that reads ``v`` once and writes the ``k`` copies, no quantized copy at token level written and gathered after
    (on an H100 at 0ab281f the two quantizations and four gathers of rows and scales took 0.78 ms of the frozen MoE's
    16.9)."""
    return quantize_1x128_rows(v, inv.view(-1, k))


class _GroupedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor, experts: Tensor,
                limit: float, backend: Backend, gate_up_a: Tensor | None = None, gate_up_b: Tensor | None = None,
                down_a: Tensor | None = None, down_b: Tensor | None = None,
                lora_scales: tuple[float, float] = (0.0, 0.0), gate_up_scale: Tensor | None = None,
                down_scale: Tensor | None = None, fp8_compute: str = "fp8") -> Tensor:
        t, d = x.shape
        k = experts.shape[-1]
        ctx.limit, ctx.backend, ctx.k, ctx.fp8_compute = limit, backend, k, fp8_compute
        ctx.weights_dtype = weights.dtype
        kernels = ctx.lora_kernels = _lora_kernels(backend, x)
        ctx.lora_scales = lora_scales
        lora = (gate_up_a, gate_up_b, down_a, down_b)
        if t * k == 0:  # static shape: nothing routed (grouped_mm is not asked to take empty operands)
            ctx.empty = True
            ctx.save_for_backward(gate_up_proj, down_proj, *lora)
            return x.new_zeros((t, d))
        ctx.empty = False
        plan = route_plan(experts, gate_up_proj.shape[0])
        w = weights.reshape(-1).index_select(0, plan.order)
        # FP8 GEMM inputs come quantized where the GEMM would quantize them (x before its gather, h by the SwiGLU
        # kernel); the bf16 rows only where LoRA's products still take them
        x_rows = _takes_rows(x, gate_up_proj, gate_up_scale, fp8_compute, trans=False)
        xp = x.index_select(0, plan.token) if not x_rows or (gate_up_a is not None and not kernels) else None
        xa = _lora_in(_t(gate_up_a), _Rows.of(xp, x, plan.token), plan.offs, kernels)
        gu = _expert_mm(_gathered_rows(x, plan.inv, k) if x_rows else xp, gate_up_proj, plan.offs, gate_up_scale,
                        fp8_compute, x.dtype, low_rank=_lora_out(xa, gate_up_b, lora_scales[0]))
        del xp
        h_rows = _takes_rows(gu, down_proj, down_scale, fp8_compute, trans=False)
        h, hq = _swiglu_fwd(backend, gu, w, limit, keep_h=down_a is not None or not h_rows, quantize=h_rows)
        ha = _lora_in(_t(down_a), _Rows(h), plan.offs, kernels)
        y = _expert_mm(hq if h_rows else h, down_proj, plan.offs, down_scale, fp8_compute, gu.dtype,
                       low_rank=_lora_out(ha, down_b, lora_scales[1]))
        del h, hq
        out = _gather_sum(backend, y, plan.inv, k)
        # with LoRA the rank-r products x a^T and h a^T ([N, r] each) are kept for the b gradients
        ctx.save_for_backward(x, gate_up_proj, down_proj, gu, w, plan.token, plan.inv, plan.offs, *lora, xa, ha,
                              gate_up_scale, down_scale)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        need_x, need_w, need_gu, need_down = ctx.needs_input_grad[:4]
        need_lora = ctx.needs_input_grad[7:11]
        if ctx.empty:
            gate_up_proj, down_proj, *lora = ctx.saved_tensors
            t = dout.shape[0]
            dx = dout.new_zeros(dout.shape) if need_x else None
            dweights = dout.new_zeros((t, ctx.k), dtype=ctx.weights_dtype) if need_w else None
            dl = [torch.zeros_like(p) if need else None for p, need in zip(lora, need_lora)]
            return _GroupedExpertsGrads(x=dx, weights=dweights,
                                        gate_up_proj=torch.zeros_like(gate_up_proj) if need_gu else None,
                                        down_proj=torch.zeros_like(down_proj) if need_down else None,
                                        gate_up_a=dl[0], gate_up_b=dl[1], down_a=dl[2], down_b=dl[3])
        (x, gate_up_proj, down_proj, gu, w, token, inv, offs, gu_a, gu_b, dn_a, dn_b, xa, ha, gate_up_scale,
         down_scale) = ctx.saved_tensors
        k, backend, compute, kernels = ctx.k, ctx.backend, ctx.fp8_compute, ctx.lora_kernels
        # as in the forward: FP8 GEMM inputs quantized before the gather (dout) or by the SwiGLU kernel (dgu)
        dy_rows = _takes_rows(dout, down_proj, down_scale, compute, trans=True)
        # [N, D]: un-permute's adjoint, a gather in expert order (LoRA's kernels read dout through the index)
        dy = dout.index_select(0, token) if need_down or not dy_rows or (dn_a is not None and not kernels) else None
        dy_r = _Rows.of(dy, dout, token)
        dyb = _lora_in(dn_b, dy_r, offs, kernels)  # dy b [N, r]
        dh = _expert_mm(_gathered_rows(dout, inv, k) if dy_rows else dy, down_proj, offs, down_scale, compute,
                        dout.dtype, trans=True, low_rank=_lora_out(dyb, _t(dn_a), ctx.lora_scales[1]))  # [N, I]
        # the kernel quantizes dgu where its two halves are whole 1x128 tiles (I % 128 == 0)
        dgu_rows = (need_x and (gu.shape[1] // 2) % BLOCK == 0
                    and _takes_rows(gu, gate_up_proj, gate_up_scale, compute, trans=True))
        # h serves only the down projection's weight gradient and its LoRA a gradient
        dgu, dguq, h, dw = _swiglu_bwd(backend, gu, w, dh, ctx.limit, quantize=dgu_rows,
                                       keep_dgu=need_gu or gu_a is not None or not dgu_rows,
                                       keep_h=need_down or need_lora[2])
        del dh
        d_down = _zero_empty_groups(_grouped_mm(dy.t(), h, offs=offs), offs) if need_down else None
        d_dn_a, d_dn_b = _lora_grads(dy_r, _Rows(h), dyb, ha, ctx.lora_scales[1], offs, need_lora[2:], kernels)
        del dy, dy_r, h, dyb
        # recomputed: [N, D] is k times x
        xp = x.index_select(0, token) if need_gu or (need_lora[0] and not kernels) else None
        d_gate_up = _zero_empty_groups(_grouped_mm(dgu.t(), xp, offs=offs), offs) if need_gu else None
        dgub = _lora_in(gu_b, _Rows(dgu), offs, kernels)  # dgu b [N, r]
        dxp = _expert_mm(dguq if dgu_rows else dgu, gate_up_proj, offs, gate_up_scale, compute, gu.dtype,
                         trans=True, low_rank=_lora_out(dgub, _t(gu_a), ctx.lora_scales[0])) if need_x else None
        del dguq
        d_gu_a, d_gu_b = _lora_grads(_Rows(dgu), _Rows.of(xp, x, token), dgub, xa, ctx.lora_scales[0], offs,
                                     need_lora[:2], kernels)
        del xp, dgub
        dx = _gather_sum(backend, dxp, inv, k) if need_x else None
        dweights = dw.index_select(0, inv).view(-1, k).to(ctx.weights_dtype) if need_w else None
        return _GroupedExpertsGrads(x=dx, weights=dweights, gate_up_proj=d_gate_up, down_proj=d_down,
                                    gate_up_a=d_gu_a, gate_up_b=d_gu_b, down_a=d_dn_a, down_b=d_dn_b)


_GroupedExpertsGrads = named_grads(_GroupedExperts)


# LoRA on the experts (the weight W + scale b a never formed): y = v W_e^T + scale (v a_e^T) b_e^T, the input
# gradient dv = dy W_e + scale (dy b_e) a_e. The rank-r product in ([N, r], kept for the factor gradients) is a
# product of its own; the product out and its sum ride on the expert GEMM (_expert_mm's low_rank). On the Triton
# path the rank-r products and the factor gradients run csattn.ops.moe.lora_triton's kernels, which read token
# rows through the index (no [N, D] copy of x or dout made for them alone); elsewhere grouped GEMMs on the rows.

class _Rows(NamedTuple):
    """Rows ``src[index]`` in expert order (``index`` None: ``src`` itself), copied out only where a consumer
    takes them whole."""

    src: Tensor
    index: Tensor | None = None

    @staticmethod
    def of(gathered: Tensor | None, src: Tensor, index: Tensor) -> _Rows:
        """The rows already gathered where they were, else ``src`` through ``index``."""
        return _Rows(src, index) if gathered is None else _Rows(gathered)

    def whole(self) -> Tensor:
        return self.src if self.index is None else self.src.index_select(0, self.index)


def _lora_kernels(backend: Backend, x: Tensor) -> bool:
    """Whether LoRA's rank-r products run the Triton kernels: the Triton path on CUDA rows, or under the CPU
    interpreter."""
    return use_triton(backend) and (interpreting() or x.is_cuda)


def _lora_in(w: Tensor | None, v: _Rows, offs: Tensor, kernels: bool) -> Tensor | None:
    """``v w_e`` ``[N, r]`` per expert group (``w [E, in, r]``: ``a^T``, or ``b`` in the backward), or None without
    LoRA."""
    if w is None:
        return None
    if kernels:
        from .lora_triton import rank_in_triton  # lazy: Triton optional

        return rank_in_triton(v.src, w, offs, v.index)
    return _grouped_mm(v.whole(), w, offs=offs)


def _lora_out(vr: Tensor | None, w: Tensor | None, scale: float) -> LowRank | None:
    """The term ``scale * vr w_e^T`` (``w [E, out, r]``) for the expert GEMM, or None without LoRA."""
    return None if vr is None or w is None else LowRank(vr, w, scale)


def _t(f: Tensor | None) -> Tensor | None:
    return None if f is None else f.transpose(-2, -1)


def _lora_grads(dy: _Rows, v: _Rows, dyb: Tensor | None, va: Tensor | None, scale: float, offs: Tensor,
                need: tuple[bool, bool], kernels: bool) -> tuple[Tensor | None, Tensor | None]:
    """``(da, db)`` of ``y = scale * (v a_e^T) b_e^T`` per expert: ``da_e = scale (dy b)_e^T v_e`` ``[E, r, in]``,
    ``db_e = scale dy_e^T (v a^T)_e`` ``[E, out, r]`` (zeros for experts without rows)."""
    if kernels:
        from .lora_triton import rank_grad_triton  # lazy: Triton optional

        da = rank_grad_triton(dyb, v.src, offs, scale, v.index) if need[0] else None
        db = rank_grad_triton(va, dy.src, offs, scale, dy.index, transpose=True) if need[1] else None
        return da, db
    da = _zero_empty_groups(_grouped_mm(dyb.t(), v.whole(), offs=offs), offs) * scale if need[0] else None
    db = _zero_empty_groups(_grouped_mm(dy.whole().t(), va, offs=offs), offs) * scale if need[1] else None
    return da, db


def _swiglu_fwd(backend: Backend, gu: Tensor, w: Tensor, limit: float, keep_h: bool,
                quantize: bool) -> tuple[Tensor | None, Fp8Rows | None]:
    """``(h, h quantized per 1x128 tile)``, each only if asked: the Triton kernel writes both in one pass; the
    PyTorch path quantizes ``h`` after it."""
    n, inter = gu.shape[0], gu.shape[1] // 2
    if not use_triton(backend):
        h = swiglu_fwd_ref(gu, w, limit)
        return (h if keep_h else None), (Fp8Rows(*quantize_1x128(h)) if quantize else None)
    from .triton import swiglu_fwd_triton  # lazy: Triton optional

    hq = Fp8Rows.empty(n, inter, gu.device) if quantize else None
    return swiglu_fwd_triton(gu, w, limit, fp8_out=hq, keep_h=keep_h), hq


def _swiglu_bwd(backend: Backend, gu: Tensor, w: Tensor, dh: Tensor, limit: float, keep_dgu: bool,
                quantize: bool, keep_h: bool) -> tuple[Tensor | None, Fp8Rows | None, Tensor | None, Tensor]:
    """``(dgu, dgu quantized per 1x128 tile, h, dw)``, the first three only if asked (as :func:`_swiglu_fwd`)."""
    if not use_triton(backend):
        dgu, h, dw = swiglu_bwd_ref(gu, w, dh, limit)
        return ((dgu if keep_dgu else None), (Fp8Rows(*quantize_1x128(dgu)) if quantize else None),
                (h if keep_h else None), dw)
    from .triton import swiglu_bwd_triton  # lazy: Triton optional

    dguq = Fp8Rows.empty(gu.shape[0], gu.shape[1], gu.device) if quantize else None
    dgu, h, dw = swiglu_bwd_triton(gu, w, dh, limit, fp8_out=dguq, keep_dgu=keep_dgu, keep_h=keep_h)
    return dgu, dguq, h, dw


def _gather_sum(backend: Backend, src: Tensor, inv: Tensor, k: int) -> Tensor:
    if not use_triton(backend):
        return gather_sum_ref(src, inv, k)
    from .triton import gather_sum_triton  # lazy: Triton optional

    return gather_sum_triton(src, inv, k)


def grouped_experts(x: Tensor, experts: Tensor, weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor,
                    limit: float, backend: Backend = "reference", gate_up_lora: ExpertLora | None = None,
                    down_lora: ExpertLora | None = None, *, gate_up_scale: Tensor | None = None,
                    down_scale: Tensor | None = None, fp8_compute: str = "fp8") -> Tensor:
    """Routed experts by grouped GEMMs (see the module docstring); operands as in
    :func:`~csattn.ops.moe.naive.experts_ref`, which must satisfy :func:`grouped_mm_supported`.

    ``gate_up_lora`` / ``down_lora``: low-rank terms per expert, each a product into the rank and the term added to
    the expert GEMM's output (forward ``(v a_e^T) b_e^T``; the backward's input gradient ``(dy b_e) a_e`` and the two
    factor gradients; on the Triton path the rank-r products run ``lora_triton.py``'s kernels).

    ``backend="triton"`` runs the SwiGLU and gather-sum as Triton kernels (CUDA, or the CPU interpreter),
    ``"reference"`` their PyTorch references. With ``gate_up_scale`` and ``down_scale`` the weights are frozen FP8
    (e4m3 with 128x128 block scales) and the GEMMs, forward and input gradient, run
    :func:`~csattn.ops.fp8.fp8_grouped_mm` (mode ``fp8_compute``); there is no weight gradient.
    """
    if not grouped_mm_supported(x, gate_up_proj, down_proj):
        raise ValueError("grouped_mm does not take these operands (dtype, device, layout or alignment): "
                         f"x {tuple(x.shape)} {x.dtype}, gate_up_proj {tuple(gate_up_proj.shape)} "
                         f"{gate_up_proj.dtype}, down_proj {tuple(down_proj.shape)} {down_proj.dtype}")
    gl, dl = gate_up_lora, down_lora
    return _GroupedExperts.apply(x, weights, gate_up_proj, down_proj, experts, float(limit), backend,
                                 *(gl[:2] if gl else (None, None)), *(dl[:2] if dl else (None, None)),
                                 (float(gl.scale) if gl else 0.0, float(dl.scale) if dl else 0.0),
                                 gate_up_scale, down_scale, fp8_compute)
