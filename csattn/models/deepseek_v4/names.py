"""Tensor names on disk <-> this model's ``state_dict`` names.

DeepSeek-V4 checkpoints (the release, and what ``transformers`` writes back on ``save_pretrained``) use the
reference names: ``layers.{i}.attn.wq_a``, ``attn.norm`` (the kv norm), ``attn.indexer.compressor.wkv``,
``ffn.experts.{e}.w1/w2/w3`` (one matrix per expert), ``hc_attn_fn``, ``head.weight``... ``transformers``
renames them when loading into ``DeepseekV4ForCausalLM``, whose names this model uses (``self_attn.q_a_proj``,
``self_attn.kv_norm``, ``self_attn.compressor.indexer.kv_proj``, ``mlp.experts.gate_up_proj [E, 2I, D]``,
``attn_hc.fn``, ``lm_head.weight``). ``to_internal`` accepts either style (with or without the ``model.``
prefix); ``to_disk`` writes what ``transformers`` writes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["to_internal", "to_disk", "internal_name"]

_ATTN = {"attn_sink": "sinks", "wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj",
         "norm": "kv_norm", "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
_COMP = {"wkv": "kv_proj", "wgate": "gate_proj", "ape": "position_bias", "norm": "kv_norm"}
_SHARED = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_BLOCK = {"attn_norm": ["input_layernorm"], "ffn_norm": ["post_attention_layernorm"],
          "hc_attn_fn": ["attn_hc", "fn"], "hc_attn_base": ["attn_hc", "base"], "hc_attn_scale": ["attn_hc", "scale"],
          "hc_ffn_fn": ["ffn_hc", "fn"], "hc_ffn_base": ["ffn_hc", "base"], "hc_ffn_scale": ["ffn_hc", "scale"],
          "hc_head_fn": ["hc_head", "hc_fn"], "hc_head_base": ["hc_head", "hc_base"],
          "hc_head_scale": ["hc_head", "hc_scale"]}
_TOP = {"embed": ["embed_tokens"], "head": ["lm_head"], **{k: v for k, v in _BLOCK.items() if k.startswith("hc_head")}}
_FP8_ROWS = 128  # rows per block scale of FP8-held weights (quant.FP8_BLOCK)
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")


def _map_attn(r: list[str]) -> list[str]:
    if r and r[0] == "compressor":
        return ["compressor", _COMP.get(r[1], r[1]), *r[2:]]
    if r and r[0] == "indexer" and len(r) > 1:
        if r[1] == "compressor":
            return ["compressor", "indexer", _COMP.get(r[2], r[2]), *r[3:]]
        if r[1] == "wq_b":
            return ["compressor", "indexer", "q_b_proj", *r[2:]]
        if r[1] == "weights_proj":
            return ["compressor", "indexer", "scorer", "weights_proj", *r[2:]]
    return [_ATTN.get(r[0], r[0]), *r[1:]] if r else r


def _map_ffn(r: list[str]) -> list[str]:
    if len(r) >= 2 and r[0] == "gate" and r[1] == "bias":
        return ["gate", "e_score_correction_bias"]
    if len(r) >= 2 and r[0] == "shared_experts":
        return ["shared_experts", _SHARED.get(r[1], r[1]), *r[2:]]
    return r


def internal_name(name: str) -> str:
    """One on-disk name (either style) -> the ``state_dict`` name (expert matrices keep their index)."""
    parts = name.split(".")
    if parts[0] == "model":
        parts = parts[1:]
    if parts[0] == "lm_head":
        return name if name.startswith("lm_head") else ".".join(parts)
    if parts[0] in ("layers", "mtp") and len(parts) > 2:
        head, r = parts[:2], parts[2:]
        if r[0] == "attn":
            r = ["self_attn", *_map_attn(r[1:])]
        elif r[0] == "self_attn":
            r = ["self_attn", *r[1:]]
        elif r[0] in ("ffn", "mlp"):
            r = ["mlp", *_map_ffn(r[1:])]
        elif r[0] in _BLOCK:
            r = _BLOCK[r[0]] + r[1:]
        mapped = head + r
    else:
        mapped = _TOP.get(parts[0], [parts[0]]) + parts[1:]
    if mapped[0] in ("lm_head", "mtp"):
        return ".".join(mapped)
    return "model." + ".".join(mapped)


def to_internal(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Rename every tensor and stack per-expert ``w1 / w3`` into ``gate_up_proj`` and ``w2`` into ``down_proj``.

    Raises ``ValueError`` on FP8-quantized weights (their ``.scale`` companions; ``load_pretrained`` dequantizes
    them) and on incomplete experts.
    """
    out: dict[str, Tensor] = {}
    experts: dict[str, dict[str, dict[int, Tensor]]] = {}
    for name, tensor in tensors.items():
        if name.endswith(".scale") and not name.endswith(("attn_hc.scale", "ffn_hc.scale")):
            raise ValueError(f"tensor {name!r} is an FP8 block scale: read_safetensors / to_internal do not "
                             "dequantize; load quantized checkpoints with load_pretrained")
        new = internal_name(name)
        m = _EXPERT.match(new)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = tensor
            continue
        if new in out:
            raise ValueError(f"tensors {name!r} and another one both map to {new!r}")
        out[new] = tensor
    for prefix, mats in experts.items():
        n = 1 + max(max(d) for d in mats.values())
        for w in ("w1", "w2", "w3"):
            have = mats.get(w, {})
            for e in range(n):
                if e not in have:
                    raise ValueError(f"checkpoint is missing tensor {prefix}.{e}.{w}.weight")
        stack = {w: torch.stack([mats[w][e] for e in range(n)]) for w in mats}
        out[prefix + ".gate_up_proj"] = torch.cat([stack["w1"], stack["w3"]], dim=1)
        out[prefix + ".down_proj"] = stack["w2"]
    return out


# ---------------------------------------------------------------------------------------------- writing
_ATTN_INV = {v: k for k, v in _ATTN.items()}
_COMP_INV = {v: k for k, v in _COMP.items()}
_SHARED_INV = {v: k for k, v in _SHARED.items()}
_BLOCK_INV = {tuple(v): k for k, v in _BLOCK.items()}


def _disk_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "lm_head":
        return ".".join(["head", *parts[1:]])
    prefix: list[str] = []
    if parts[0] == "model":
        prefix, parts = ["model"], parts[1:]
    if parts[0] not in ("layers", "mtp") or len(parts) < 3:
        return ".".join(prefix + parts)  # embed_tokens, norm, hc_head.* keep HF's names (as transformers writes)
    head, r = parts[:2], parts[2:]
    if tuple(r[:2]) in _BLOCK_INV:
        r = [_BLOCK_INV[tuple(r[:2])], *r[2:]]
    elif r[0] in ("input_layernorm", "post_attention_layernorm"):
        r = [_BLOCK_INV[(r[0],)], *r[1:]]
    elif r[0] == "self_attn":
        a = r[1:]
        if a[0] == "compressor" and a[1] == "indexer":
            sub = a[2:]
            if sub[0] == "q_b_proj":
                a = ["indexer", "wq_b", *sub[1:]]
            elif sub[0] == "scorer":
                a = ["indexer", "weights_proj", *sub[2:]]
            else:
                a = ["indexer", "compressor", _COMP_INV.get(sub[0], sub[0]), *sub[1:]]
        elif a[0] == "compressor":
            a = ["compressor", _COMP_INV.get(a[1], a[1]), *a[2:]]
        else:
            a = [_ATTN_INV.get(a[0], a[0]), *a[1:]]
        r = ["attn", *a]
    elif r[0] == "mlp":
        f = r[1:]
        if f[:2] == ["gate", "e_score_correction_bias"]:
            f = ["gate", "bias"]
        elif f[0] == "shared_experts":
            f = ["shared_experts", _SHARED_INV.get(f[1], f[1]), *f[2:]]
        r = ["ffn", *f]
    return ".".join(prefix + head + r)


def to_disk(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state_dict`` -> the names and per-expert matrices that ``transformers`` writes (FP8-held experts' block
    scales ``*_proj_scale_inv`` per expert matrix too, as ``experts.{e}.w1.weight_scale_inv``)."""
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        suffix = ".weight_scale_inv" if name.endswith("_scale_inv") else ".weight"
        fused = name.removesuffix("_scale_inv")
        if fused.endswith("mlp.experts.gate_up_proj"):
            base = _disk_name(fused[: -len(".gate_up_proj")])
            if suffix != ".weight" and (state[fused].shape[1] // 2) % _FP8_ROWS:
                raise ValueError(f"{name}: the gate and up halves share a 128-row block (moe_intermediate_size is "
                                 "not a multiple of 128), so FP8 experts cannot be written per expert")
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{base}.{e}.w1{suffix}"] = gate[e].contiguous()
                out[f"{base}.{e}.w3{suffix}"] = up[e].contiguous()
        elif fused.endswith("mlp.experts.down_proj"):
            base = _disk_name(fused[: -len(".down_proj")])
            for e in range(tensor.shape[0]):
                out[f"{base}.{e}.w2{suffix}"] = tensor[e].contiguous()
        else:
            out[_disk_name(name)] = tensor
    return out
