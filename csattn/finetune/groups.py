"""Parameter groups of :class:`~csattn.models.deepseek_v4.DeepseekV4ForCausalLM` by name, and what each one does in
a run: trained in full, frozen, or adapted by LoRA.

Every parameter (the MTP blocks' too) belongs to exactly one group:

===============  ==================================================================================================
attention        ``self_attn.*`` outside the compressor: q_a / q_b / kv / o_a / o_b projections, q_a / kv norms, sinks
indexer          ``self_attn.compressor.indexer.*`` (the CSA layers' lightning indexer)
compressor       the rest of ``self_attn.compressor.*`` (kv / gate projections, position bias, kv norm)
mhc              the hyper-connections ``attn_hc``, ``ffn_hc``, ``hc_head`` and the RMSNorms of the sites they feed
                 (``input_layernorm``, ``post_attention_layernorm``)
router           ``mlp.gate.weight``
shared_experts   ``mlp.shared_experts.*``
experts          ``mlp.experts.*`` (the routed experts' 3-D tensors)
embed            ``model.embed_tokens``
head             ``lm_head``, the final ``model.norm``; an MTP block's own head: ``e_proj``, ``h_proj``, ``enorm``,
                 ``hnorm``, ``norm``
===============  ==================================================================================================

A frozen parameter gets ``requires_grad_(False)``: no gradient, no optimizer state (the optimizer takes trainable
parameters only), no gradient reduction under FSDP2 (it reduce-scatters the gradients that exist).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from ..models.deepseek_v4.groups import DEFAULT_LORA_TARGETS, GROUPS, LORA_GROUPS, group_of

__all__ = ["GROUPS", "LORA_GROUPS", "group_of", "parse_groups", "Choice", "resolve_choice", "apply_freezing"]


def parse_groups(text: str | Iterable[str] | None, flag: str, allowed: tuple[str, ...] = GROUPS) -> tuple[str, ...]:
    """A comma list of group names (or a sequence of them) -> the names in ``GROUPS`` order; unknown ones raise
    ``ValueError`` naming ``flag``."""
    if text is None:
        return ()
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text)]
    items = [s for s in items if s]
    bad = [s for s in items if s not in allowed]
    if bad:
        raise ValueError(f"{flag}: unknown group(s) {', '.join(map(repr, bad))}; choose from {', '.join(allowed)}")
    return tuple(g for g in allowed if g in items)


@dataclass(frozen=True)
class Choice:
    """What each group does: ``train`` in full, ``lora`` (base frozen, adapted), the rest frozen."""

    train: tuple[str, ...]
    lora: tuple[str, ...]

    @property
    def frozen(self) -> tuple[str, ...]:
        return tuple(g for g in GROUPS if g not in self.train)

    @property
    def everything_trains(self) -> bool:
        return self.train == GROUPS


def resolve_choice(train: str | None, freeze: str | None, lora_targets: str | None, lora_rank: int) -> Choice:
    """The groups' roles from ``--train``, ``--freeze``, ``--lora-targets`` and ``--lora-rank``.

    Without LoRA every group trains unless ``--freeze`` names it, or only those ``--train`` names. With LoRA
    (``lora_rank > 0``) the ``--lora-targets`` groups (default ``DEFAULT_LORA_TARGETS``) are adapted,
    those ``--train`` names train in full beside them (PEFT's ``modules_to_save``), and every other group is
    frozen, as in PEFT. Conflicting choices raise ``ValueError`` naming the flags.
    """
    trained = parse_groups(train, "--train")
    frozen = parse_groups(freeze, "--freeze")
    targets = parse_groups(lora_targets, "--lora-targets", LORA_GROUPS)
    if train is not None and freeze is not None:
        raise ValueError("--train and --freeze both given: pass one (--train G: only G trains; --freeze G: all but "
                         "G train)")
    if lora_rank <= 0:
        if lora_targets is not None:
            raise ValueError("--lora-targets needs --lora-rank R > 0 (0 = no LoRA)")
        return Choice(train=trained if train is not None else tuple(g for g in GROUPS if g not in frozen), lora=())
    targets = targets if lora_targets is not None else DEFAULT_LORA_TARGETS
    if not targets:
        raise ValueError("--lora-targets names no group: give at least one of " + ", ".join(LORA_GROUPS))
    for flag, groups in (("--freeze", frozen), ("--train", trained)):
        clash = [g for g in groups if g in targets]
        if clash:
            raise ValueError(f"{flag} {','.join(clash)} and --lora-targets {','.join(clash)}: a group is adapted, "
                             "trained in full or frozen, one of them")
    # a group trained in full beside LoRA is saved as whole modules (PEFT's modules_to_save): the attention's sinks
    # are the attention module's own, the compressor's position bias the compressor's, and those hold the
    # compressor's and the indexer's linears
    for outer, inner in (("attention", ("compressor", "indexer")), ("compressor", ("indexer",))):
        inside = [g for g in inner if g in targets]
        if outer in trained and inside:
            raise ValueError(f"--train {outer} with --lora-targets {','.join(inside)}: the {outer} module is saved "
                             f"whole in the adapter and holds the {', '.join(inside)} linears, which PEFT cannot "
                             f"adapt inside it; adapt {outer} too or train {', '.join(inside)} in full")
    return Choice(train=trained, lora=targets)


def apply_freezing(model: nn.Module, choice: Choice) -> None:
    """``requires_grad_`` on every parameter of the model (before LoRA factors are added, or those are skipped:
    they are not in any group): True for the groups ``choice.train`` names, False for all others."""
    for name, p in model.named_parameters():
        if _is_adapter(name):
            continue
        p.requires_grad_(group_of(name) in choice.train)


def _is_adapter(name: str) -> bool:
    return any(part.startswith("lora_") for part in name.split("."))
