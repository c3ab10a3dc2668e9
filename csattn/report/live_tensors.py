"""What a forward keeps alive for its backward, storage by storage: the accounting under ``csattn report``'s one
activation-memory number and ``python -m benchmarks.live_tensors``'s tables, and what the memory tests bound.

:class:`LiveStorages` records (weakly) every storage an op outputs, so the ones still alive later (saved for the
backward, held by an autograd function, or the output) can be listed with their shape, dtype and the op that made
them; :func:`model_kept` sums them per model component (:class:`ModuleScope`).
"""

from __future__ import annotations

import gc
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveStorages", "ModuleScope", "model_kept"]


class LiveStorages(TorchDispatchMode):
    """Records every storage an op outputs (weakly), so the ones still alive later can be listed.

    With ``track_peak``, after every op it also sums the bytes of the recorded storages still alive (leaving out
    the storages in ``exclude``) and keeps the list of them at the largest sum seen: what is alive at the peak of
    a forward + backward, tensor by tensor, on any device.
    """

    def __init__(self, track_peak: bool = False, exclude: set[int] | None = None,
                 where: Callable[[], str] | None = None) -> None:
        super().__init__()
        self.made: dict[int, tuple] = {}
        self.where = where  # names the component that made each storage (see ModuleScope)
        self.origin: dict[int, str] = {}
        self.track_peak = track_peak
        self.exclude = exclude or set()
        self.peak_bytes = 0
        self.peak_rows: list[tuple[int, tuple, str, str]] = []
        self.peak_op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                old = self.made.get(s.data_ptr())
                # an address freed earlier in the forward can be handed out again: the newest storage wins
                if s.nbytes() > 0 and (old is None or old[0]() is None):
                    self.made[s.data_ptr()] = (weakref.ref(s), tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                               s.nbytes(), str(func).removeprefix("aten."))
                    if self.where is not None:
                        self.origin[s.data_ptr()] = self.where()
        if self.track_peak:
            self.made = {ptr: v for ptr, v in self.made.items() if v[0]() is not None}
            total = sum(v[3] for ptr, v in self.made.items() if ptr not in self.exclude)
            if total > self.peak_bytes:
                self.peak_bytes, self.peak_op = total, str(func).removeprefix("aten.")
                self.peak_rows = self.alive(self.exclude)
        return out

    def alive(self, exclude: set[int]) -> list[tuple[int, tuple, str, str]]:
        """``(bytes, shape, dtype, op)`` of the recorded storages still alive, largest first."""
        rows = [(nb, shape, dt, op) for ptr, (ref, shape, dt, nb, op) in self.made.items()
                if ptr not in exclude and ref() is not None]
        return sorted(rows, key=lambda r: -r[0])

    def alive_by_origin(self, exclude: set[int]) -> dict[str, int]:
        """Bytes of the storages still alive, summed per component (needs ``where``)."""
        out: dict[str, int] = defaultdict(int)
        for ptr, (ref, _, _, nb, _) in self.made.items():
            if ptr not in exclude and ref() is not None:
                out[self.origin.get(ptr, "")] += nb
        return dict(out)


class ModuleScope:
    """Which submodule of ``model`` is running now: forward pre / post hooks keep a stack of module names.

    ``current()`` is the innermost running module's name cut to ``depth`` parts after a ``layers.{i}`` /
    ``mtp.{j}`` prefix (``model.layers.1.mlp.experts`` -> ``model.layers.1.mlp`` at depth 1), so what a block's
    own forward makes (the mHC combine) is named by the block, what its children make by the child.
    """

    def __init__(self, model: torch.nn.Module, depth: int = 1) -> None:
        self.model, self.depth, self.stack, self.handles = model, depth, [""], []

    def current(self) -> str:
        return self.stack[-1]

    def _short(self, name: str) -> str:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in ("layers", "mtp") and i + 1 < len(parts):
                return ".".join(parts[: i + 2 + self.depth])
        return ".".join(parts[:2])

    def __enter__(self) -> ModuleScope:
        def pop(module: torch.nn.Module, args: Any, output: Any) -> None:  # a hook's return value replaces output
            self.stack.pop()

        for name, module in self.model.named_modules():
            if not name:
                continue
            short = self._short(name)
            self.handles.append(module.register_forward_pre_hook(lambda m, a, s=short: self.stack.append(s)))
            self.handles.append(module.register_forward_hook(pop))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def model_kept(model: torch.nn.Module, forward: Callable[[], Any], depth: int = 1) -> tuple[dict[str, int], Any]:
    """Bytes that ``forward()`` (a model forward returning the loss) leaves alive for the backward, per component
    (:class:`ModuleScope` names), parameters and buffers left out. Returns them and ``forward()``'s result."""
    own = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    gc.collect()
    with ModuleScope(model, depth) as scope, LiveStorages(where=scope.current) as live:
        out = forward()
    gc.collect()
    return live.alive_by_origin(own), out
