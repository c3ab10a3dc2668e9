"""The trainer's fine-tuning phase, called from its build step: which groups train, freeze or take LoRA
(``--train``, ``--freeze``, ``--lora-targets``, ``--lora-rank / -alpha / -dropout``), applied to the model between
the expert split and FSDP (:meth:`Finetune.prepare`), the adapters drawn once the weights exist
(:meth:`Finetune.initialize`), and what a checkpoint holds besides its DCP shards: ``adapter/`` in PEFT's format and,
with ``--export-hf``, the merged model. A resumed run must use the same choices (:func:`resume_mismatch`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..parallel import Meshes, export_hf
from ..parallel.export import full_tensor
from ..parallel.init import copy_into
from .groups import Choice, apply_freezing, resolve_choice
from .lora import LoraSpec, add_lora, init_lora, lora_modules
from .peft_format import merge_lora, merged_config, save_adapter, saved_modules

__all__ = ["Finetune", "OPTIONS", "ADAPTER_DIR", "resume_mismatch", "save_adapters", "export_merged"]

ADAPTER_DIR = "adapter"
# the TrainConfig fields (flags) that decide what trains; a resume must keep them
OPTIONS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "train_groups", "freeze_groups",
           "base_precision", "fp8_linears")
FLAGS = {"lora_rank": "--lora-rank", "lora_alpha": "--lora-alpha", "lora_dropout": "--lora-dropout",
         "lora_targets": "--lora-targets", "train_groups": "--train", "freeze_groups": "--freeze",
         "base_precision": "--base-precision", "fp8_linears": "--fp8-linears"}


@dataclass(frozen=True)
class Finetune:
    """The run's choice of what trains, and its LoRA (``spec`` None: no LoRA)."""

    choice: Choice
    spec: LoraSpec | None
    seed: int

    @classmethod
    def from_options(cls, cfg: Any) -> Finetune:
        """From the trainer's options (the ``OPTIONS`` fields and ``seed``); raises ``ValueError`` naming the flags
        of a conflicting choice."""
        choice = resolve_choice(cfg.train_groups, cfg.freeze_groups, cfg.lora_targets, cfg.lora_rank)
        if cfg.lora_rank < 0 or cfg.lora_alpha <= 0 or not 0 <= cfg.lora_dropout < 1:
            raise ValueError(f"--lora-rank {cfg.lora_rank}, --lora-alpha {cfg.lora_alpha}, --lora-dropout "
                             f"{cfg.lora_dropout}: need a rank >= 0 (0 = no LoRA), an alpha > 0 and a dropout in "
                             "[0, 1)")
        read = [g for g in choice.lora if g != "compressor"]
        if cfg.lora_rank > 0 and cfg.lora_dropout > 0 and read:
            raise ValueError(f"--lora-dropout {cfg.lora_dropout} with --lora-targets {','.join(choice.lora)}: the "
                             f"groups {', '.join(read)} have linears whose weight the layer reads directly, whose "
                             "fused paths apply no input dropout to LoRA's term (PEFT refuses it for "
                             "target_parameters too): pass --lora-dropout 0, or --lora-targets compressor")
        spec = LoraSpec(cfg.lora_rank, float(cfg.lora_alpha), float(cfg.lora_dropout), choice.lora) \
            if cfg.lora_rank > 0 else None
        return cls(choice, spec, int(cfg.seed))

    @property
    def active(self) -> bool:
        return self.spec is not None or not self.choice.everything_trains

    def prepare(self, model: nn.Module) -> None:
        """Freeze what does not train and add the LoRA factors (zeros). After the expert split, before FSDP."""
        if not self.active:
            return
        apply_freezing(model, self.choice)
        if self.spec is not None:
            add_lora(model, self.spec)
            saved_modules(model)  # what PEFT cannot hold is refused before training, not at the first save

    def initialize(self, model: nn.Module) -> nn.Module:
        """Draw the adapters (each rank its shard of the same values) once the model has storage and weights."""
        if self.spec is not None:
            params = {id(p): n for n, p in model.named_parameters()}
            init_lora(model, self.seed, copy=lambda dest, full: copy_into(model, full, params[id(dest)]))
        return model

    def router_bias_rate(self, rate: float) -> float:
        """A frozen router keeps its load-balancing bias too (an adapter holds no bias: HF's model with the
        adapter would route otherwise)."""
        return rate if "router" in self.choice.train else 0.0


def save_adapters(model: nn.Module, path: str, meshes: Meshes) -> None:
    """``path/adapter/`` in PEFT's format when the model has LoRA (a collective; rank 0 writes), else nothing."""
    modules = lora_modules(model)
    if modules:
        save_adapter(model, os.path.join(path, ADAPTER_DIR), _spec_of(modules),
                     gather=lambda n, t: full_tensor(t, n, meshes), write=meshes.rank == 0)


def export_merged(model: nn.Module, path: str, meshes: Meshes) -> None:
    """The HF-format model under ``path`` (a collective), any LoRA adapters merged into their weights."""
    modules = lora_modules(model)
    scale = modules[0][1].lora_scale if modules else None
    if modules:
        export_hf(model, path, meshes, transform=lambda unit: merge_lora(unit, scale), config=merged_config)
    else:
        export_hf(model, path, meshes)


def _spec_of(modules: list[tuple[str, nn.Module]]) -> LoraSpec:
    from .groups import group_of
    from .lora import LoraExperts

    name, first = modules[0]
    a = first.lora_A_gate_up if isinstance(first, LoraExperts) else first.lora_A
    rank = a.shape[-2]
    dropout = getattr(getattr(first, "lora_dropout", None), "p", 0.0)
    targets = tuple(dict.fromkeys(group_of(n + (".gate_up_proj" if isinstance(m, LoraExperts) else ".weight"))
                                  for n, m in modules))
    return LoraSpec(rank, first.lora_scale * rank, float(dropout), targets)


def resume_mismatch(saved: dict[str, Any] | None, current: dict[str, Any]) -> str | None:
    """One line naming the flags whose values differ from the resumed checkpoint's (None when they agree). A
    checkpoint written before these options existed counts as the defaults."""
    if not saved:
        return None
    defaults = {"lora_rank": 0, "lora_alpha": 16.0, "lora_dropout": 0.0, "base_precision": "bf16",
                "fp8_linears": False}
    diff = [k for k in OPTIONS if saved.get(k, defaults.get(k)) != current.get(k, defaults.get(k))]
    if not diff:
        return None
    what = ", ".join(f"{FLAGS[k]} {current.get(k)!r} (checkpoint: {saved.get(k, defaults.get(k))!r})" for k in diff)
    return (f"resuming with other fine-tuning choices than the checkpoint's: {what}; pass the checkpoint's values, "
            "or start a new run from its merged export with --init-from")

