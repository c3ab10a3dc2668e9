"""Provider registry: each op (``sparse_attn``, ``layer``, ...) has named providers that build a timed case.

A provider is a function ``build(shape: dict, device, dtype, variant: str) -> Case`` registered with
``@register(op, name)`` in a module under ``benchmarks/providers/`` (every module there is imported by
the runner, so adding a file is enough). ``shape`` holds the CLI's shape options; ``variant`` is the text
in brackets after the provider name on the command line (``triton[bk_fwd=64]``), empty by default.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["Case", "Skip", "PROVIDERS", "SHAPE_DEFAULTS", "register", "load_providers"]


class Skip(Exception):
    """Raised by a provider whose case does not apply (too large for memory, missing package, ...)."""


@dataclass
class Case:
    """One benchmark case.

    Args:
        forward: runs the op on ``leaves`` and returns the output tensors.
        leaves: inputs whose gradients the backward computes (``requires_grad=True``).
        flops: nominal FLOPs per mode (``"fwd"``, ``"bwd"``; ``"fwdbwd"`` defaults to their sum).
        info: free-form facts recorded in the JSON (index density, config, ...).
    """

    forward: Callable[[], tuple[torch.Tensor, ...]]
    leaves: list[torch.Tensor]
    flops: dict[str, float]
    info: dict = field(default_factory=dict)


# op -> provider name -> build function
PROVIDERS: dict[str, dict[str, Callable[..., Case]]] = {}
# op -> default shape options (the runner's CLI can override any key with --shape key=value)
SHAPE_DEFAULTS: dict[str, dict] = {}


def register(op: str, name: str, defaults: dict | None = None):
    """Decorator: register ``build`` as provider ``name`` of ``op`` (and the op's default shape options)."""

    def wrap(build):
        PROVIDERS.setdefault(op, {})[name] = build
        if defaults:
            SHAPE_DEFAULTS.setdefault(op, {}).update(defaults)
        return build

    return wrap


def load_providers() -> None:
    """Import every module of ``benchmarks.providers`` so their ``@register`` calls run."""
    from . import providers

    for mod in pkgutil.iter_modules(providers.__path__):
        importlib.import_module(f"{providers.__name__}.{mod.name}")
