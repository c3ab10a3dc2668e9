"""Mixed precision: what csattn's modules and ops do under ``torch.autocast``.

Autocast picks a dtype per torch op while the forward runs. csattn's fused ops are autograd Functions whose
backward recomputes parts of the forward with plain torch ops, and the backward runs outside the autocast region:
left to autocast, a recomputation would run in other dtypes than its forward (mixed-dtype errors, or silently
other values), and an ``out=`` GEMM would meet operands autocast cast differently. So each csattn entry point fixes
its dtypes once and runs with autocast off inside:

- the attention layer (:class:`csattn.HybridAttention`) and the routed experts (:func:`csattn.ops.moe.moe_experts`),
  the GEMM work, run in the autocast dtype: the input and the matmul weights are cast to it (autocast's rule for a
  linear), while the sinks, position biases, router biases, mHC and norm weights stay fp32 (:func:`keeps_fp32`).
  That is exactly what the same layer computes after ``to_training_dtype(dtype)``, the path the bf16 tests and
  kernels cover, and gradients reach the fp32 master weights through the casts;
- the mHC (sites, combine, head) computes its weights in fp32 from the streams in their own dtype, with or
  without autocast (the residual streams stay fp32 under autocast, as in HF).

fp64 is left alone, as autocast leaves it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import Tensor, nn

__all__ = ["FP32_MODULES", "autocast_dtype", "autocast_off", "keeps_fp32", "low_precision_parameters"]

# Kept in fp32 whatever the training dtype (HF's ``_keep_in_fp32_modules_strict``), and any norm weight too.
FP32_MODULES = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias")
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def keeps_fp32(name: str) -> bool:
    """Whether the parameter or buffer ``name`` (dotted, as ``named_parameters`` gives it) stays fp32 in a
    low-precision model: the mHC, sinks, position biases, router biases, norm weights and RoPE frequencies."""
    parts = name.split(".")
    return any(part in FP32_MODULES or part.endswith("norm") for part in parts) or parts[-1] == "inv_freq"


def autocast_dtype(t: Tensor) -> torch.dtype | None:
    """The dtype autocast runs ``t``'s device's matmuls in, or None when autocast is off there (or ``t`` is fp64,
    which autocast leaves alone)."""
    device = t.device.type
    if t.dtype == torch.float64 or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def autocast_off(t: Tensor) -> AbstractContextManager:
    """Autocast disabled on ``t``'s device (a null context when it is off already)."""
    device = t.device.type
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else nullcontext()


@contextmanager
def low_precision_parameters(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Inside, ``module``'s floating parameters read as their ``dtype`` casts, except those :func:`keeps_fp32`
    keeps (and fp64 ones): a differentiable cast per parameter, so gradients reach the parameters themselves.

    The module's ``_parameters`` entries are swapped for the casts and put back on exit (what
    ``torch.func.functional_call`` does, without calling the module again: its hooks run once). Modules holding
    frozen FP8 weights (``frozen_storage``) keep their codes and scales (HF's FP8 modules hold fp32 scales as
    parameters); their compute dtype (the empty ``dtype_tag`` buffer) reads as ``dtype`` too.
    """
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    tags: list[tuple[nn.Module, Tensor]] = []
    try:
        for prefix, mod in module.named_modules():
            tag = mod._buffers.get("dtype_tag") if getattr(mod, "frozen_storage", None) else None
            if tag is not None and tag.dtype in _CASTABLE and tag.dtype != dtype:
                mod._buffers["dtype_tag"] = tag.to(dtype)
                tags.append((mod, tag))
            frozen = getattr(mod, "frozen_storage", ())
            for name, p in list(mod._parameters.items()):
                if p is None or p.dtype == dtype or p.dtype not in _CASTABLE or name in frozen:
                    continue
                if keeps_fp32(f"{prefix}.{name}" if prefix else name):
                    continue
                mod._parameters[name] = p.to(dtype)
                swapped.append((mod, name, p))
        yield
    finally:
        for mod, name, p in reversed(swapped):
            mod._parameters[name] = p
        for mod, tag in tags:
            mod._buffers["dtype_tag"] = tag
