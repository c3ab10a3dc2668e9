"""Nested Python state (optimizer, scheduler, RNG, counters, configs) stored so that loading runs no code.

``torch.save`` / ``torch.load(weights_only=False)`` pickle, and unpickling a file from elsewhere can run
anything it names. Here the tensors go into a safetensors file and everything else (dicts, lists, tuples,
numbers, strings, None) into JSON kept in that file's metadata header, so one file holds the whole state and
is written with one atomic rename. Loading parses JSON and raw tensor bytes only.

Encoding: a tensor becomes ``{"__tensor__": name}``; a tuple ``{"__tuple__": [...]}``; a dict whose keys are
all strings not starting with ``"__"`` stays a JSON object, any other dict (e.g. the optimizer's integer
parameter ids) becomes ``{"__dict__": [[key, value], ...]}``. Floats round-trip exactly (``repr``), NaN and
infinities included.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["save_state", "load_state"]

_META_KEY = "csattn_state"
_FORMAT = "csattn-safe-state-1"


def _encode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        # own contiguous CPU copy: safetensors refuses shared or strided storage
        tensors[name] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": name}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{where}[{k!r}]") for k, v in obj.items()}
        return {"__dict__": [[_encode(k, tensors, f"{where} key"), _encode(v, tensors, f"{where}[{k!r}]")]
                             for k, v in obj.items()]}
    raise TypeError(f"{where} is a {type(obj).__name__}; the safe state format stores tensors, dicts, lists, "
                    "tuples, numbers, strings and None only")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if set(obj) == {"__tensor__"}:
        return tensors[obj["__tensor__"]]
    if set(obj) == {"__tuple__"}:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if set(obj) == {"__dict__"}:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__dict__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def save_state(path: str, state: Any) -> None:
    """Write ``state`` to the safetensors file ``path`` (atomically: a temporary file, then a rename)."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors, "state")
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"format": _FORMAT, _META_KEY: json.dumps(tree)})
    os.replace(tmp, path)


def load_state(path: str) -> Any:
    """Read what :func:`save_state` wrote (tensors on the CPU). Runs no code from the file."""
    with safe_open(path, framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
        if meta.get("format") != _FORMAT or _META_KEY not in meta:
            raise ValueError(f"{path} is not a csattn state file (no {_META_KEY!r} metadata); was it written by "
                             "csattn.train.checkpoint.safe_state.save_state?")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return _decode(json.loads(meta[_META_KEY]), tensors)
