"""Routed experts of a mixture of experts: tokens permuted once by expert, two grouped GEMMs, a fused clamped
SwiGLU, no host read of device data. See ``README.md``."""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from ...amp import autocast_dtype, autocast_off
from ..backend import check_backend
from ..backend import resolve_backend as _resolve
from ..fp8 import check_compute, check_weight
from .grouped import RoutePlan, grouped_experts, grouped_mm_supported, route_plan
from .naive import ExpertLora, clamped_swiglu, experts_ref, gather_sum_ref, swiglu_bwd_ref, swiglu_fwd_ref

__all__ = ["BACKENDS", "ExpertLora", "MoeBackend", "RoutePlan", "clamped_swiglu", "expert_load", "experts_ref",
           "gather_sum_ref", "grouped_experts", "grouped_mm_supported", "moe_experts", "resolve_backend", "route_plan",
           "swiglu_bwd_ref", "swiglu_fwd_ref"]

# the backends of every op (csattn.ops.backend.BackendChoice) and "grouped": grouped GEMMs with the elementwise
# parts in PyTorch (what "auto" takes off CUDA)
MoeBackend = Literal["auto", "reference", "grouped", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "grouped", "triton")


def resolve_backend(backend: MoeBackend, x: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> str:
    """The path :func:`moe_experts` takes: ``"reference"``, ``"grouped"`` or ``"triton"``.

    - ``"reference"``: the per-expert loop (:func:`experts_ref`).
    - ``"grouped"``: grouped GEMMs with the SwiGLU and un-permute in PyTorch.
    - ``"triton"``: grouped GEMMs with the SwiGLU and un-permute as Triton kernels.
    - ``"auto"``: ``"triton"`` on CUDA, ``"grouped"`` elsewhere.

    Where ``grouped_mm`` cannot take the operands (fp64 or fp16, D or I not a multiple of 16 bytes, mixed
    dtypes, non-contiguous weights) every backend runs the reference: it is the exact same math, and the model
    runs in fp64 in the tests.
    """
    if check_backend(backend, BACKENDS) == "reference" or not grouped_mm_supported(x, gate_up_proj, down_proj):
        return "reference"
    return _resolve(backend, x, choices=BACKENDS, off_cuda="grouped")


def moe_experts(x: Tensor, experts: Tensor, weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor,
                limit: float, backend: MoeBackend = "auto", gate_up_lora: ExpertLora | None = None,
                down_lora: ExpertLora | None = None, *, gate_up_scale: Tensor | None = None,
                down_scale: Tensor | None = None, fp8_compute: str = "fp8") -> Tensor:
    """Weighted sum of each token's ``k`` routed experts, clamped-SwiGLU MLPs.

    Args:
        x: ``[T, D]`` token rows. experts: ``[T, k]`` int64 expert ids in ``[0, E)``.
        weights: ``[T, k]`` routing weights (differentiable).
        gate_up_proj: ``[E, 2I, D]``, the gate rows first. down_proj: ``[E, D, I]``.
        limit: ``silu(min(gate, limit)) * clamp(up, -limit, limit)``.
        backend: ``"auto"``, ``"reference"``, ``"grouped"`` or ``"triton"`` (see :func:`resolve_backend`).
        gate_up_lora, down_lora: optional LoRA per expert on the two weights (:class:`ExpertLora`: ``a [E, r, in]``,
            ``b [E, out, r]``, ``scale``): expert ``e`` uses ``W[e] + scale * b[e] @ a[e]``, computed as two more
            (grouped) GEMMs through the rank, never formed. Gradients flow to ``a`` and ``b`` too.
        gate_up_scale, down_scale: both or neither: frozen FP8 experts, ``gate_up_proj`` / ``down_proj`` in
            ``float8_e4m3fn`` (not requiring grad) with fp32 block scales ``[E, 2I/128, D/128]`` /
            ``[E, D/128, I/128]``; the GEMMs run :func:`~csattn.ops.fp8.fp8_grouped_mm` (forward and input
            gradient), the reference dequantizes one expert at a time. fp8_compute: its mode, ``"fp8"`` or
            ``"w8a16"``.

    Returns:
        ``[T, D]`` in ``x.dtype``: ``sum_j weights[t, j] * down[e_j] @ swiglu(gate_up[e_j] @ x[t])``.
        Gradients flow to ``x``, ``weights``, ``gate_up_proj`` and ``down_proj`` (FP8 weights: to ``x`` and
        ``weights`` only). Under ``torch.autocast`` ``x`` and the two weights (not FP8 ones) are cast to the
        autocast dtype first and the result is in it (as for a linear; see :mod:`csattn.amp`).
    """
    if (gate_up_scale is None) != (down_scale is None):
        raise ValueError("give both gate_up_scale and down_scale (frozen FP8 experts) or neither")
    fp8 = gate_up_scale is not None
    loras = (gate_up_lora, down_lora)
    low = autocast_dtype(x)
    if low is not None:  # the dtypes decided once: the grouped backward recomputes outside autocast
        with autocast_off(x):
            gu, dn = (gate_up_proj, down_proj) if fp8 else (gate_up_proj.to(low), down_proj.to(low))
            gl, dl = (None if lo is None else ExpertLora(lo.a.to(low), lo.b.to(low), lo.scale) for lo in loras)
            return moe_experts(x.to(low), experts, weights, gu, dn, limit, backend, gl, dl,
                               gate_up_scale=gate_up_scale, down_scale=down_scale, fp8_compute=fp8_compute)
    if fp8:
        check_compute(fp8_compute)
        check_weight(gate_up_proj, gate_up_scale, "gate_up_proj")
        check_weight(down_proj, down_scale, "down_proj")
    path = resolve_backend(backend, x, gate_up_proj, down_proj)
    if path != "reference" and not all(lo is None or _lora_fits(x, lo) for lo in loras):
        path = "reference"  # the same math; grouped_mm cannot take these factors
    if path == "reference":
        return experts_ref(x, experts, weights, gate_up_proj, down_proj, limit, gate_up_lora, down_lora,
                           gate_up_scale, down_scale)
    return grouped_experts(x, experts, weights, gate_up_proj, down_proj, limit,
                           backend="triton" if path == "triton" else "reference", gate_up_lora=gate_up_lora,
                           down_lora=down_lora, gate_up_scale=gate_up_scale, down_scale=down_scale,
                           fp8_compute=fp8_compute)


def _lora_fits(x: Tensor, lora: ExpertLora) -> bool:
    """Whether ``grouped_mm`` takes the LoRA factors beside ``x``: its dtype and device, contiguous, and a rank
    whose rows are a multiple of 16 bytes (r a multiple of 4 in fp32, of 8 in bf16)."""
    a, b = lora.a, lora.b
    same = a.dtype == b.dtype == x.dtype and a.device == b.device == x.device
    return same and a.is_contiguous() and b.is_contiguous() and a.shape[1] % (16 // x.element_size()) == 0


def expert_load(experts: Tensor, num_experts: int, real: Tensor | None = None) -> Tensor:
    """``[E]`` int64: how many assignments of ``experts [T, k]`` (of the rows with ``real [T]`` True, if given)
    went to each expert; a ``scatter_add_`` on the device, no host read (``bincount`` reads the maximum id on
    CUDA, boolean indexing the count of True rows)."""
    flat = experts.reshape(-1).long()
    ones = flat.new_ones(flat.shape) if real is None else real[:, None].expand(experts.shape).reshape(-1).long()
    return flat.new_zeros(num_experts).scatter_add_(0, flat, ones)
