"""The model's parameter groups by name: the one map the trainer (``csattn.finetune``: freezing, LoRA targets) and
the planner (``csattn.parallel.plan``: counts by group) both read. See ``csattn/finetune/groups.py`` for what each
group covers."""

from __future__ import annotations

__all__ = ["GROUPS", "LORA_GROUPS", "DEFAULT_LORA_TARGETS", "group_of"]

GROUPS = ("attention", "indexer", "compressor", "mhc", "router", "shared_experts", "experts", "embed", "head")
# the groups whose linears (or expert tensors) take LoRA; norms, sinks and biases in them stay frozen
LORA_GROUPS = ("attention", "indexer", "compressor", "shared_experts", "experts")
# adapted by --lora-rank when --lora-targets is not given (csattn train and csattn plan alike): the attention's and
# the indexer's linears, the shared and the routed experts
DEFAULT_LORA_TARGETS = ("attention", "indexer", "shared_experts", "experts")
# A block's two RMSNorms go with the mHC (they norm the collapsed residual stream); an MTP block's input
# projections and norms with the head.
_MHC = ("attn_hc", "ffn_hc", "hc_head", "input_layernorm", "post_attention_layernorm")
_MTP_HEAD = ("e_proj", "h_proj", "enorm", "hnorm", "norm")
_MLP = {"gate": "router", "shared_experts": "shared_experts", "experts": "experts"}


def group_of(name: str) -> str:
    """The group of a parameter of the model by its name (``named_parameters()``, HF DeepseekV4 layout; FSDP2 keeps
    the names): ``model.layers.3.self_attn.q_a_proj.weight`` -> ``attention``. Raises ``ValueError`` for a name of
    no group."""
    parts = name.split(".")
    if parts[0] == "model":
        parts = parts[1:]
    if parts[0] == "embed_tokens":
        return "embed"
    if parts[0] in ("lm_head", "norm"):
        return "head"
    if parts[0] == "hc_head":
        return "mhc"
    if parts[0] in ("layers", "mtp") and len(parts) > 3:
        sub = parts[2:]
        if sub[0] == "self_attn":
            if sub[1] == "compressor":
                return "indexer" if sub[2] == "indexer" else "compressor"
            return "attention"
        if sub[0] == "mlp" and sub[1] in _MLP:
            return _MLP[sub[1]]
        if sub[0] in _MHC:
            return "mhc"
        if parts[0] == "mtp" and sub[0] in _MTP_HEAD:
            return "head"
    raise ValueError(f"parameter {name!r} belongs to no parameter group (groups: {', '.join(GROUPS)})")
