"""Bitwise reproducible training steps: :func:`set_deterministic`.

Two things make two runs of the same step differ: scatter-add gradients summed with fp32 atomics in the fused
kernels (sparse attention's key gradient, the indexer loss's key gradient), and torch ops with nondeterministic
CUDA implementations (cuBLAS's split workspaces, ``index_add_`` / ``index_put_`` with accumulation, ...). The
first is fixed by exact fixed-point sums (``csattn/ops/fixed_point.py``), chosen by ``deterministic=1`` on the
kernel configs (``AttentionConfig.deterministic``, ``DeepseekV4ModelConfig.deterministic``, the HF ``patch(...,
deterministic=True)``) or by torch's deterministic mode; the second by torch's deterministic mode. This module
turns the latter on.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["deterministic_mode", "set_deterministic"]

_CUBLAS_WORKSPACE = ":4096:8"


def set_deterministic(enabled: bool = True, warn_only: bool = False, fill_uninitialized_memory: bool = False) -> None:
    """Turn deterministic mode on (or off) for the whole process.

    ``torch.use_deterministic_algorithms(enabled, warn_only=warn_only)``, cuDNN deterministic and without
    autotuning, and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in the environment where it is unset (cuBLAS reads it when
    it creates its handle: call this before the first CUDA matrix product, or export the variable in the shell).
    ``fill_uninitialized_memory``: torch's own setting of that name, which its deterministic mode turns on: every
    new tensor from ``torch.empty`` (and the like) is filled with NaN, a write pass over every activation and
    buffer the step allocates. It is off here: it only matters to an op that reads memory it did not write, and
    csattn's kernels write every element they return (their tests fill outputs with NaN before the launch).
    Under torch's deterministic mode the fused kernels sum their scatter-add gradients in exact fixed point even
    where their configs do not ask for it (``csattn.ops.fixed_point.wants_deterministic``), and a torch op without
    a deterministic implementation raises (``warn_only=True``: warns).

    Example:
        >>> import csattn
        >>> csattn.set_deterministic()  # first thing in the training script
    """
    if enabled and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            warnings.warn("set_deterministic: CUDA is already initialized; set CUBLAS_WORKSPACE_CONFIG=:4096:8 "
                          "before the first CUDA matrix product (e.g. in the shell) for deterministic cuBLAS",
                          stacklevel=2)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = _CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill_uninitialized_memory
    torch.backends.cudnn.deterministic = enabled
    if enabled:
        torch.backends.cudnn.benchmark = False


@contextmanager
def deterministic_mode(enabled: bool = True, warn_only: bool = False) -> Iterator[None]:
    """:func:`set_deterministic` for the ``with`` block; the process's previous settings (torch's deterministic
    mode, its warn-only flag and memory fill, cuDNN's two flags) come back after it. ``CUBLAS_WORKSPACE_CONFIG``
    stays set (cuBLAS reads it once).

    Example:
        >>> with csattn.deterministic_mode():
        ...     train(...)
    """
    fill = torch.utils.deterministic
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              fill.fill_uninitialized_memory, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    set_deterministic(enabled, warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        fill.fill_uninitialized_memory = before[2]
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[3], before[4]
