"""Fine-tuning: which parameters train (groups), LoRA on the linears and the routed experts, adapters in PEFT's
format, the merge for export, and the trainer's wiring of them. Knows the model's module names; the model knows
no LoRA."""

from .groups import GROUPS, LORA_GROUPS, Choice, apply_freezing, group_of, parse_groups, resolve_choice
from .lora import LoraSpec, add_lora, init_lora, lora_modules

__all__ = ["GROUPS", "LORA_GROUPS", "Choice", "LoraSpec", "add_lora", "apply_freezing", "group_of", "init_lora",
           "lora_modules", "parse_groups", "resolve_choice"]
