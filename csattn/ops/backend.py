"""The one backend choice every op's dispatch point makes: the plain-PyTorch reference or the fused Triton
kernels (CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

from typing import Literal

__all__ = ["Backend", "use_triton"]

Backend = Literal["reference", "triton"]
BACKENDS: tuple[str, ...] = ("reference", "triton")


def use_triton(backend: str) -> bool:
    """True for ``"triton"``, False for ``"reference"``; anything else is a ``ValueError`` naming the choices."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'reference' or 'triton', got {backend!r}")
    return backend == "triton"
