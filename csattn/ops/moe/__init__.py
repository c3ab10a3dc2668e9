"""Routed experts of a mixture of experts: tokens permuted once by expert, two grouped GEMMs, a fused clamped
SwiGLU, no host read of device data. See ``README.md``."""

from __future__ import annotations

from torch import Tensor

from ...amp import autocast_dtype, autocast_off
from ..backend import check_backend
from ..backend import resolve_backend as _resolve
from .grouped import RoutePlan, grouped_experts, grouped_mm_supported, route_plan
from .naive import ExpertLora, clamped_swiglu, experts_ref, gather_sum_ref, swiglu_bwd_ref, swiglu_fwd_ref

__all__ = ["BACKENDS", "ExpertLora", "RoutePlan", "clamped_swiglu", "expert_load", "experts_ref", "gather_sum_ref",
           "grouped_experts", "grouped_mm_supported", "moe_experts", "resolve_backend", "route_plan",
           "swiglu_bwd_ref", "swiglu_fwd_ref"]

BACKENDS = ("auto", "reference", "grouped", "triton")


def resolve_backend(backend: str, x: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> str:
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
                limit: float, backend: str = "auto", gate_up_lora: ExpertLora | None = None,
                down_lora: ExpertLora | None = None) -> Tensor:
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

    Returns:
        ``[T, D]`` in ``x.dtype``: ``sum_j weights[t, j] * down[e_j] @ swiglu(gate_up[e_j] @ x[t])``.
        Gradients flow to ``x``, ``weights``, ``gate_up_proj`` and ``down_proj``. Under ``torch.autocast``
        ``x`` and the two weights are cast to the autocast dtype first and the result is in it (as for a linear;
        see :mod:`csattn.amp`).
    """
    loras = (gate_up_lora, down_lora)
    low = autocast_dtype(x)
    if low is not None:  # the dtypes decided once: the grouped backward recomputes outside autocast
        with autocast_off(x):
            gl, dl = (None if lo is None else ExpertLora(lo.a.to(low), lo.b.to(low), lo.scale) for lo in loras)
            return moe_experts(x.to(low), experts, weights, gate_up_proj.to(low), down_proj.to(low), limit, backend,
                               gl, dl)
    path = resolve_backend(backend, x, gate_up_proj, down_proj)
    if path != "reference" and not all(lo is None or _lora_fits(x, lo) for lo in loras):
        path = "reference"  # the same math; grouped_mm cannot take these factors
    if path == "reference":
        return experts_ref(x, experts, weights, gate_up_proj, down_proj, limit, gate_up_lora, down_lora)
    return grouped_experts(x, experts, weights, gate_up_proj, down_proj, limit, use_triton=path == "triton",
                           gate_up_lora=gate_up_lora, down_lora=down_lora)


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
