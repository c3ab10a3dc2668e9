"""The one backend choice every op's dispatch point makes: the plain-PyTorch reference or the fused Triton
kernels (CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import functools
from typing import Literal

import torch

__all__ = ["Backend", "sm_count", "use_triton"]

Backend = Literal["reference", "triton"]
BACKENDS: tuple[str, ...] = ("reference", "triton")


def use_triton(backend: str) -> bool:
    """True for ``"triton"``, False for ``"reference"``; anything else is a ``ValueError`` naming the choices."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'reference' or 'triton', got {backend!r}")
    return backend == "triton"


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the kernels size persistent grids and waves by it)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
