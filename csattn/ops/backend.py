"""The one backend choice every op makes: the plain-PyTorch reference or the fused Triton kernels (CUDA, or the
CPU interpreter under ``TRITON_INTERPRET=1``), with ``"auto"`` resolved on the tensors' device.

Every op and module that takes a ``backend`` resolves it here (:func:`resolve_backend`): the attention ops'
dispatch points take the resolved ``"reference"`` / ``"triton"`` (:func:`use_triton`); the layer, mHC, MoE,
RMSNorm and the HF integration take ``"auto"`` too. :func:`interpreting` is the one reading of
``TRITON_INTERPRET``.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

__all__ = ["BACKENDS", "Backend", "BackendChoice", "check_backend", "interpreting", "resolve_backend", "sm_count",
           "torch_grouped_mm", "triton_version", "use_triton"]

Backend = Literal["reference", "triton"]
BackendChoice = Literal["auto", "reference", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "triton")
# torch's grouped GEMM over row groups (``offs``), public from torch 2.9 as F.grouped_mm; None where torch has none
torch_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET`` set to a true value), read at
    each call so a test may set it."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes", "y")


@functools.cache
def triton_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed Triton (its Gluon kernels depend on the release: measured on 3.6)."""
    import re

    import triton  # lazy: Triton optional

    major, minor = (int(part) for part in re.findall(r"\d+", triton.__version__)[:2])
    return major, minor


def check_backend(backend: str, choices: tuple[str, ...] = BACKENDS) -> str:
    """``backend`` itself if it is one of ``choices``, else a ``ValueError`` naming them."""
    if backend not in choices:
        raise ValueError(f"backend must be one of {', '.join(map(repr, choices))}, got {backend!r}")
    return backend


def resolve_backend(backend: str, where: torch.Tensor | torch.device | str, *, choices: tuple[str, ...] = BACKENDS,
                    off_cuda: str = "reference") -> str:
    """The path ``backend`` takes on ``where`` (a tensor or its device): ``"auto"`` is ``"triton"`` on CUDA and
    ``off_cuda`` elsewhere (the reference; MoE's grouped GEMMs); any other value of ``choices`` is itself.
    ``"triton"`` off CUDA is a ``ValueError`` saying what to use instead, unless Triton's CPU interpreter is on
    (Triton itself would fail deep inside the first launch with "0 active drivers")."""
    check_backend(backend, choices)
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    if backend == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(f"backend 'triton' runs the Triton kernels, which need CUDA tensors; these are on "
                         f"{device.type}: use 'auto' (the reference off CUDA) or 'reference' (csattn train: "
                         "--backend auto), or set TRITON_INTERPRET=1 for Triton's CPU interpreter "
                         "(slow; for tests)")
    if backend != "auto":
        return backend
    return "triton" if device.type == "cuda" else off_cuda


def use_triton(backend: str) -> bool:
    """True for ``"triton"``, False for ``"reference"`` (an attention op's dispatch point takes a resolved
    backend); anything else is a ``ValueError`` naming the choices."""
    return check_backend(backend, ("reference", "triton")) == "triton"


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the kernels size persistent grids and waves by it)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
