"""HF-format checkpoints: ``config.json`` + ``model.safetensors`` (or sharded with
``model.safetensors.index.json``). On disk the tensors carry the DeepSeek reference names that the release
and ``transformers``' ``save_pretrained`` use; ``names.py`` maps them to this model's ``state_dict`` names
(equal to ``transformers.DeepseekV4ForCausalLM``'s). MTP blocks, which ``transformers`` skips on load, are
stored under ``mtp.{j}.``."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .config import DeepseekV4ModelConfig
from .model import DeepseekV4ForCausalLM
from .names import _disk_name, to_disk, to_internal

__all__ = ["load_pretrained", "save_pretrained", "load_state_dict_into", "read_safetensors", "read_config"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def read_config(path: str) -> dict[str, Any]:
    """The ``config.json`` of an HF-format directory as a dict."""
    file = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(file):
        raise ValueError(f"path {path!r} has no {CONFIG_NAME}")
    with open(file) as f:
        return json.load(f)


def read_safetensors(path: str) -> dict[str, Tensor]:
    """All tensors of the directory (single file or sharded via the index), renamed to ``state_dict`` names."""
    from safetensors.torch import load_file

    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
        shards = [WEIGHTS_NAME]
    else:
        shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not shards:
            raise ValueError(f"path {path!r} has no .safetensors files")
    tensors: dict[str, Tensor] = {}
    for shard in shards:
        tensors.update(load_file(os.path.join(path, shard)))
    return to_internal(tensors)


def load_state_dict_into(model: DeepseekV4ForCausalLM, tensors: Mapping[str, Tensor],
                         allow_missing_prefixes: tuple[str, ...] = ()) -> None:
    """Copy ``tensors`` into ``model`` (casting to each parameter's dtype).

    Raises ``ValueError`` naming the tensor when one is missing (unless under ``allow_missing_prefixes``),
    unexpected, or shaped differently from the model's config.
    """
    own = model.state_dict()
    tied = model.config.tie_word_embeddings
    missing = [k for k in own if k not in tensors and not k.startswith(allow_missing_prefixes)
               and not (tied and k == "lm_head.weight")]
    unexpected = [k for k in tensors if k not in own]
    if missing:
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r} (on disk {_disk_name(missing[0])!r}; "
                         f"{len(missing)} missing in all: {missing[:8]})")
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensor {unexpected[0]!r} (on disk "
                         f"{_disk_name(unexpected[0])!r}; {len(unexpected)} in all: {unexpected[:8]}); does its "
                         "config match the model's?")
    for name, tensor in tensors.items():
        if tuple(own[name].shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name!r} (on disk {_disk_name(name)!r}) has shape {tuple(tensor.shape)} in "
                             f"the checkpoint but the config gives {tuple(own[name].shape)}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            own[name].copy_(tensor)


def load_pretrained(path: str, mtp: bool | None = None, dtype: torch.dtype | None = None,
                    **config_overrides: Any) -> DeepseekV4ForCausalLM:
    """Build :class:`DeepseekV4ForCausalLM` from an HF-format directory.

    Args:
        path: directory with ``config.json`` and safetensors.
        mtp: ``None`` builds the config's MTP blocks only if the checkpoint holds ``mtp.*`` tensors (HF-saved
            checkpoints do not); ``True`` builds them anyway (fresh weights when absent); ``False`` never.
        dtype: training dtype (see ``DeepseekV4ForCausalLM.to_training_dtype``); default fp32.
        config_overrides: fields of :class:`DeepseekV4ModelConfig` (e.g. ``indexer_loss_coeff``).
    """
    raw = read_config(path)
    tensors = read_safetensors(path)
    has_mtp = any(k.startswith("mtp.") for k in tensors)
    n_mtp = int(raw.get("num_nextn_predict_layers", 0) or 0)
    if mtp is False or (mtp is None and not has_mtp):
        if has_mtp:
            tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
        n_mtp = 0
    config_overrides.setdefault("num_nextn_predict_layers", n_mtp)
    config = DeepseekV4ModelConfig.from_hf(raw, **config_overrides)
    model = DeepseekV4ForCausalLM(config)
    if mtp and not has_mtp and n_mtp:
        warnings.warn(f"{path}: no mtp.* tensors; the {n_mtp} MTP block(s) start from fresh weights", stacklevel=2)
    load_state_dict_into(model, tensors, allow_missing_prefixes=("mtp.",) if mtp and not has_mtp else ())
    if dtype is not None:
        model.to_training_dtype(dtype)
    return model


def save_pretrained(model: DeepseekV4ForCausalLM, path: str) -> None:
    """Write ``config.json`` and ``model.safetensors`` with the names ``transformers`` writes (tied LM head
    stored once)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    cfg = model.config.to_hf_dict()
    cfg["num_nextn_predict_layers"] = len(model.mtp)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = to_disk(state)
    tmp = os.path.join(path, WEIGHTS_NAME + ".tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, WEIGHTS_NAME))
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
