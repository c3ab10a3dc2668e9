"""The frozen base's precision in the trainer (``--base-precision``, ``--fp8-linears``, ``--allow-inexact-fp8``):
the routed experts (and, asked, the frozen dense linears) of a release checkpoint held in FP8 as it stores them,
never a bf16 copy. :func:`check_base_precision` refuses what cannot work before any process group exists;
:func:`hold_base` gives the model on the meta device its FP8-held modules before it is sharded; the weights then
come from ``--init-from`` (``csattn.parallel.load_hf_sharded``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..models.deepseek_v4.checkpoint import BASE_PRECISIONS, held_linears
from ..models.deepseek_v4.quant import hold_in_fp8
from ..parallel import ParallelDims
from ..parallel.plan.counts import FP8_GROUPS
from .groups import Choice, group_of

__all__ = ["check_base_precision", "check_fp8_mesh", "fp8_linear_names", "hold_base"]


def check_base_precision(cfg: Any, choice: Choice) -> None:
    """``ValueError`` naming the flags when ``cfg`` (``base_precision``, ``fp8_linears``, ``allow_inexact_fp8``,
    ``init_from``) asks for FP8-held weights that cannot be: without ``--init-from`` (they have no initializer), or
    with the routed experts trained in full (FP8-held weights are frozen)."""
    precision = cfg.base_precision
    if precision not in BASE_PRECISIONS:
        raise ValueError(f"--base-precision must be one of {', '.join(BASE_PRECISIONS)}, got {precision!r}")
    if precision == "bf16":
        if cfg.fp8_linears or cfg.allow_inexact_fp8:
            flag = "--fp8-linears" if cfg.fp8_linears else "--allow-inexact-fp8"
            raise ValueError(f"{flag} applies to FP8-held weights: pass --base-precision fp8 or w8a16 with it")
        return
    if not cfg.init_from:
        raise ValueError(f"--base-precision {precision} holds the routed experts as a release checkpoint stores "
                         "them (FP8 / MXFP4), and FP8-held weights have no initializer: pass --init-from DIR (a "
                         "quantized HF-format checkpoint), or --base-precision bf16")
    if "experts" in choice.train:
        how = "every group trains (no --lora-rank, --train or --freeze)" if choice.everything_trains \
            else "--train includes experts"
        raise ValueError(f"--base-precision {precision} holds the routed experts frozen in FP8, but {how}: freeze "
                         "them (--lora-rank R, --freeze experts, or a --train without experts), or pass "
                         "--base-precision bf16 to train them")


def check_fp8_mesh(dims: ParallelDims, base_precision: str) -> None:
    """FP8-held experts are split by expert parallelism alone (``ParallelDims.check_fp8_experts``: ep must be
    dp_shard x cp); ``ValueError`` naming ``--ep`` otherwise."""
    if base_precision != "bf16":
        dims.check_fp8_experts()


def fp8_linear_names(path: str, choice: Choice, mtp: bool) -> list[str]:
    """Module names of the dense linears ``--fp8-linears`` holds in FP8: those the checkpoint at ``path`` stores in
    FP8, of the frozen groups of the planner's ``FP8_GROUPS`` that LoRA does not adapt (an adapter beside a dense
    linear needs its weight in the compute dtype; the MTP blocks' ``e_proj`` / ``h_proj``, group ``head``, stay in
    the compute dtype); MTP blocks' only when the model has them (``mtp``)."""
    keep = (set(choice.frozen) - set(choice.lora)) & FP8_GROUPS  # as the planner counts them
    return [n for n in held_linears(path) if group_of(n + ".weight") in keep and (mtp or not n.startswith("mtp."))]


def hold_base(model: nn.Module, cfg: Any, choice: Choice) -> nn.Module:
    """Give the model (on the meta device, before it is sharded) its FP8-held modules for ``cfg.base_precision``
    (nothing for ``"bf16"``): every routed expert, and with ``cfg.fp8_linears`` the dense linears of
    :func:`fp8_linear_names`. Returns ``model``."""
    if cfg.base_precision == "bf16":
        return model
    linears = fp8_linear_names(cfg.init_from, choice, len(model.mtp) > 0) if cfg.fp8_linears else ()
    return hold_in_fp8(model, cfg.base_precision, linears)
