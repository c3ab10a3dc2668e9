"""Sharded training checkpoints through ``torch.distributed.checkpoint`` (DCP): model and optimizer state, each
rank writing its own shards, read back onto any mesh (DCP reshards by the saved offsets).

Routed experts of an expert-parallel rank are its slice of the layer's ``[E, ...]`` tensors; in the checkpoint
they are stored as the whole ``[E, ...]`` tensor (a ``DTensor`` over the ``ep`` x ``efsdp`` mesh), so a run
with another ``ep`` (or one process) reads exactly the experts it holds.

Loading runs no code from the checkpoint: DCP keeps its metadata file as a pickle, so it is read with an
unpickler that admits only DCP's own metadata classes and plain containers (:class:`SafeReader`); tensor data
is read by ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ..models.deepseek_v4.moe import Experts
from .mesh import Meshes

__all__ = ["save_sharded", "load_sharded", "SafeReader", "DCP_DIR"]

DCP_DIR = "dcp"


def save_sharded(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, meshes: Meshes) -> None:
    """Write the model and optimizer state under ``path/dcp`` (a collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    state = _state(model, optimizer, meshes)
    with _one_process_is_intended():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(path, DCP_DIR)))


@contextmanager
def _one_process_is_intended() -> Iterator[None]:
    """Without a process group DCP warns on every save and load that it assumes one process: here that is the run's
    mesh, not a mistake (its other warnings stay)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        yield


def load_sharded(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, meshes: Meshes) -> None:
    """Read ``path/dcp`` into ``model`` and ``optimizer`` (a collective), whatever mesh wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    where = os.path.join(path, DCP_DIR)
    if not os.path.isdir(where):
        raise ValueError(f"{path} has no {DCP_DIR}/: not a checkpoint written by save_sharded")
    reader = SafeReader(where)
    state = _state(model, optimizer, meshes)
    _check_shapes(path, reader.read_metadata(), state["model"])
    with _one_process_is_intended():
        dcp.load(state, storage_reader=reader)
    model_sd, optim_sd = _local_view(state["model"], meshes), _local_view(state["optim"], meshes)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _check_shapes(path: str, metadata: Any, model_sd: dict[str, Any]) -> None:
    """A checkpoint of another model config fails naming the first tensor whose (global) shape differs."""
    saved = metadata.state_dict_metadata
    for name, t in model_sd.items():
        meta = saved.get(f"model.{name}")
        size = getattr(meta, "size", None)
        if isinstance(t, Tensor) and size is not None and tuple(size) != tuple(t.shape):
            raise ValueError(f"checkpoint {path}: tensor {name!r} has shape {tuple(size)} in the checkpoint but the "
                             f"model's config gives {tuple(t.shape)}: resume with the checkpoint's model options")
        if isinstance(t, Tensor) and meta is None:
            raise ValueError(f"checkpoint {path} has no tensor {name!r}: it was written for another model config")


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, meshes: Meshes) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": _global_view(model_sd, model, meshes), "optim": _global_view(optim_sd, model, meshes)}


def _expert_params(model: nn.Module) -> dict[str, Experts]:
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            # every parameter of it (adapters too) and, when held in FP8, its codes and per-expert scale buffers:
            # all hold the experts on dim 0
            held = [p for p, _ in module.named_parameters(recurse=False)]
            for p in dict.fromkeys([*held, *getattr(module, "frozen_storage", ())]):
                names[f"{name}.{p}"] = module
    return names


def _global_view(tree: Any, model: nn.Module, meshes: Meshes) -> Any:
    """``tree`` (a state dict) with each expert-parallel rank's expert tensors shown as the layer's whole
    ``[E, ...]`` tensor (sharing storage with the rank's slice)."""
    if meshes.dims.ep == 1:
        return tree
    experts = _expert_params(model)

    def walk(node: Any, key: str | None) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, k if k in experts else key) for k, v in node.items()}
        if isinstance(node, Tensor) and key is not None and node.dim() >= 1:
            return _as_global(node, experts[key], meshes)
        return node

    return walk(tree, None)


def _as_global(t: Tensor, experts: Experts, meshes: Meshes) -> Tensor:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    local = t.to_local() if isinstance(t, DTensor) else t
    shape = (experts.num_experts, *t.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    # FSDP shards a parameter over efsdp; a buffer (an FP8-held expert's scales) is whole on every efsdp rank
    efsdp = Shard(0) if isinstance(t, DTensor) else Replicate()
    view = DTensor.from_local(local, meshes.experts, (Replicate(), Shard(0), efsdp), run_check=False,
                              shape=torch.Size(shape), stride=stride)
    view._csattn_local = t  # the rank's own (FSDP) tensor, restored by _local_view
    return view


def _local_view(tree: Any, meshes: Meshes) -> Any:
    if meshes.dims.ep == 1:
        return tree
    if isinstance(tree, dict):
        return {k: _local_view(v, meshes) for k, v in tree.items()}
    return getattr(tree, "_csattn_local", tree)


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch sizes / dtypes / storage-free descriptors and builtin containers."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint._extension",
                "torch.distributed.checkpoint.storage")
    # _get_layout maps a layout's name (e.g. "torch.strided") to the layout object, nothing else
    _NAMES = {("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout"),
              ("collections", "OrderedDict"), ("builtins", "slice"),
              ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "tuple"), ("builtins", "list"),
              ("builtins", "dict"),
              ("enum", "Enum"), ("pathlib", "PosixPath"), ("pathlib", "Path")}

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES or (module, name) in self._NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which a DCP checkpoint never "
                                     "holds: refusing to load it (it could run code)")


class SafeReader:
    """``FileSystemReader`` whose metadata is unpickled with :class:`_MetadataUnpickler` (built lazily so the
    module imports without ``torch.distributed.checkpoint``)."""

    def __new__(cls, path: str) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        class _Reader(FileSystemReader):
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                from torch.distributed.checkpoint.metadata import StorageMeta

                name = (self._get_metadata_path(kwargs.get("rank")) if hasattr(self, "_get_metadata_path")
                        else self.fs.concat_path(self.path, ".metadata"))
                with self.fs.create_stream(name, "rb") as f:
                    metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                return metadata

        return _Reader(path)
