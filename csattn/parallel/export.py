"""HF-format export of a sharded model: one FSDP unit at a time is gathered to rank 0 and written as its own
safetensors file, with ``model.safetensors.index.json`` naming where each tensor is; rank 0 never holds more than
one unit (in the training dtype), no rank ever the whole model."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..models.deepseek_v4 import DeepseekV4ForCausalLM
from ..models.deepseek_v4.checkpoint import hf_config
from ..models.deepseek_v4.disk import CONFIG_NAME, INDEX_NAME
from ..models.deepseek_v4.names import to_disk
from .mesh import Meshes

__all__ = ["export_hf", "full_state_dict", "full_grads", "full_tensor"]


def _unit_of(name: str) -> str:
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"layer-{int(parts[2]):03d}"
    if parts[0] == "mtp":
        return f"mtp-{int(parts[1]):02d}"
    return "top"


def full_tensor(t: Tensor, name: str, meshes: Meshes) -> Tensor:
    """The whole tensor of the model's parameter or buffer ``name`` on every rank of its meshes (a collective under
    sharding: FSDP all-gather; routed experts also over ``ep``)."""
    from torch.distributed.tensor import DTensor

    full = t.full_tensor() if isinstance(t, DTensor) else t
    if meshes.dims.ep > 1 and ".mlp.experts." in name:
        # FP8-held experts' codes travel as bytes (gloo has no float8 collectives)
        raw = full.detach().view(torch.uint8) if full.dtype == torch.float8_e4m3fn else full
        parts = [torch.empty_like(raw) for _ in range(meshes.dims.ep)]
        dist.all_gather(parts, raw.contiguous(), group=meshes.ep_group)
        full = torch.cat(parts).view(full.dtype)
    return full.detach()


def full_state_dict(model: DeepseekV4ForCausalLM, meshes: Meshes, unit: str | None = None) -> dict[str, Tensor]:
    """The whole ``state_dict`` (or one unit's: ``"top"``, ``"layer-003"``, ``"mtp-00"``) on every rank, on the
    CPU (a collective). For tests and small models; :func:`export_hf` writes a large one unit by unit."""
    out = {}
    for name, t in model.state_dict().items():
        if unit is None or _unit_of(name) == unit:
            out[name] = full_tensor(t, name, meshes).cpu()
    return out


def full_grads(model: DeepseekV4ForCausalLM, meshes: Meshes) -> dict[str, Tensor]:
    """Every parameter's whole gradient on every rank, on the CPU (a collective; for tests and small models)."""
    return {name: full_tensor(p.grad, name, meshes).cpu() for name, p in model.named_parameters()
            if p.grad is not None}


def export_hf(model: DeepseekV4ForCausalLM, path: str, meshes: Meshes,
              transform: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None,
              config: Callable[[dict], dict] | None = None) -> None:
    """Write ``config.json``, one safetensors file per unit and ``model.safetensors.index.json`` under ``path``
    (a collective; rank 0 writes). Loads with :func:`csattn.models.deepseek_v4.checkpoint.load_pretrained` and
    ``transformers`` alike. ``transform``: maps each unit's whole tensors (model names) to what is written, e.g.
    adapters merged into their weights (``csattn.finetune``); ``config``: maps the config written likewise."""
    from safetensors.torch import save_file

    if not meshes.distributed and transform is None:  # one process holds the whole model anyway: one file
        from ..models.deepseek_v4.checkpoint import save_pretrained

        save_pretrained(model, path)
        return
    state = model.state_dict()
    units = sorted({_unit_of(n) for n in state})
    write = meshes.rank == 0
    if write:
        os.makedirs(path, exist_ok=True)
    weight_map: dict[str, str] = {}
    for i, unit in enumerate(units):
        tensors = {}
        for name, t in state.items():
            if _unit_of(name) != unit:
                continue
            full = full_tensor(t, name, meshes)
            if write and not (model.config.tie_word_embeddings and name == "lm_head.weight"):
                tensors[name] = full.cpu().contiguous()
        if write:
            file = f"model-{i + 1:05d}-of-{len(units):05d}.safetensors"
            disk = to_disk(transform(tensors) if transform is not None else tensors)
            save_file(disk, os.path.join(path, file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(disk, file))
            del tensors, disk
    if write:
        with open(os.path.join(path, INDEX_NAME), "w") as f:
            json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        cfg = hf_config(model) if config is None else config(hf_config(model))
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
    if meshes.distributed:
        dist.barrier()
