"""``csattn train``'s fine-tuning flags (their values land in ``TrainConfig``'s fields of the same names)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..models.deepseek_v4.checkpoint import BASE_PRECISIONS
from .groups import DEFAULT_LORA_TARGETS, GROUPS, LORA_GROUPS

__all__ = ["add_finetune_args", "checked"]


def checked(kind: type, ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` for which ``ok`` holds, else an error saying the value must be ``what``
    (argparse names the flag), so a bad value fails at parse time."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


_rank = checked(int, lambda v: v >= 0, "an integer >= 0 (0 = no LoRA)")
_alpha = checked(float, lambda v: 0 < v < float("inf"), "a finite number > 0")
_dropout = checked(float, lambda v: 0 <= v < 1, "a number in [0, 1)")


def add_finetune_args(parser: argparse.ArgumentParser) -> None:
    """Register ``--lora-rank``, ``--lora-alpha``, ``--lora-dropout``, ``--lora-targets``, ``--train``, ``--freeze``,
    ``--base-precision``, ``--fp8-linears``, ``--allow-inexact-fp8``."""
    f = parser.add_argument_group("fine-tuning (what trains)")
    groups = ", ".join(GROUPS)
    f.add_argument("--lora-rank", type=_rank, default=0, metavar="R",
                   help="LoRA of rank R on the --lora-targets groups, every other group frozen (PEFT's way); the "
                        "checkpoints hold adapter/ in PEFT's format, --export-hf the merged model; a multiple of 8 "
                        "keeps the routed experts' LoRA on the grouped GEMMs in bf16 (another rank takes the "
                        "per-expert loop, which reads the host) (default 0 = off)")
    f.add_argument("--lora-alpha", type=_alpha, default=16.0, help="LoRA scale alpha / R (default %(default)s)")
    f.add_argument("--lora-dropout", type=_dropout, default=0.0,
                   help="dropout on the LoRA inputs of linears called as modules; refused for groups whose weight "
                        "the layer reads directly (attention, indexer, shared_experts, experts) (default 0)")
    f.add_argument("--lora-targets", metavar="GROUPS", default=None,
                   help=f"comma list of the groups LoRA adapts, of {', '.join(LORA_GROUPS)} (default: "
                        f"{','.join(DEFAULT_LORA_TARGETS)})")
    f.add_argument("--train", dest="train_groups", metavar="GROUPS", default=None,
                   help=f"comma list of the only groups that train in full, the others frozen (groups: {groups}); "
                        "with --lora-rank beside the adapted groups (saved whole in the adapter, PEFT's "
                        "modules_to_save); not with --freeze")
    f.add_argument("--freeze", dest="freeze_groups", metavar="GROUPS", default=None,
                   help="comma list of groups to freeze (no gradient, no optimizer state); the others train (with "
                        "--lora-rank: frozen anyway unless adapted); a frozen router keeps its balance bias too")
    f.add_argument("--base-precision", choices=BASE_PRECISIONS, default="bf16",
                   help="the frozen base from --init-from's release checkpoint: bf16 = dequantized to the training "
                        "dtype; fp8 = routed experts held in FP8 as stored (MXFP4 converted exactly), multiplied on "
                        "FP8 tensor cores; w8a16 = held in FP8, multiplied with bf16 numerics. fp8 / w8a16 need "
                        "--init-from, frozen routed experts (LoRA or --freeze experts) and --ep = dp_shard x cp "
                        "(default %(default)s)")
    f.add_argument("--fp8-linears", action="store_true",
                   help="with --base-precision fp8 / w8a16, also hold in FP8 the frozen dense linears the "
                        "checkpoint stores in FP8, of the groups LoRA does not adapt (default: routed experts only)")
    f.add_argument("--allow-inexact-fp8", action="store_true",
                   help="with --base-precision fp8 / w8a16, round the MXFP4 expert blocks that FP8 with one "
                        "power-of-two scale per 128x128 block cannot hold exactly, instead of refusing the load")
