"""Bitwise reproducible training steps: the ``deterministic`` flag and :func:`deterministic_mode`.

Two things make two runs of the same step differ, and each has one switch:

- scatter-add gradients summed with fp32 atomics in the fused kernels (sparse attention's key gradient, the
  indexer loss's key gradient). The flag ``deterministic=True`` sums them in exact fixed point instead
  (``csattn/ops/fixed_point.py``). It is set once by its owner and passed down explicitly: ``csattn train
  --deterministic`` -> ``DeepseekV4ModelConfig.deterministic`` (or the HF ``patch(..., deterministic=True)``) ->
  every layer's ``AttentionConfig.deterministic`` -> the ``deterministic`` field of the layer's kernel configs
  (``SparseAttnConfig``, ``IndexerLossConfig``), which is all the kernels read.
- torch ops with nondeterministic CUDA implementations (cuBLAS's split workspaces, ``index_add_`` / ``index_put_``
  with accumulation, ...): :func:`deterministic_mode` turns torch's deterministic mode on for a ``with`` block. It
  does not change what csattn's kernels do.

``csattn train --deterministic`` does both; a script of its own sets the flag on its config and runs its steps
inside :func:`deterministic_mode`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["deterministic_mode"]

_CUBLAS_WORKSPACE = ":4096:8"


@contextmanager
def deterministic_mode(warn_only: bool = False) -> Iterator[None]:
    """Torch's deterministic mode for the ``with`` block; the process's previous settings (torch's deterministic
    mode, its warn-only flag and memory fill, cuDNN's two flags) come back after it.

    Inside: ``torch.use_deterministic_algorithms(True, warn_only=warn_only)`` (a torch op without a deterministic
    implementation raises; ``warn_only=True``: warns), cuDNN deterministic and without autotuning, and
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in the environment where it is unset. cuBLAS reads that variable once, when
    it creates its handle: enter the block before the first CUDA matrix product, or export the variable in the
    shell; it stays set after the block. Torch's ``fill_uninitialized_memory`` (which its deterministic mode turns
    on: every new tensor from ``torch.empty`` filled with NaN, a write pass over every activation and buffer the
    step allocates) is off: it only matters to an op that reads memory it did not write, and csattn's kernels write
    every element they return (their tests fill outputs with NaN before the launch).

    Example:
        >>> with csattn.deterministic_mode():
        ...     train(...)
    """
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            warnings.warn("deterministic_mode: CUDA is already initialized; set CUBLAS_WORKSPACE_CONFIG=:4096:8 "
                          "before the first CUDA matrix product (e.g. in the shell) for deterministic cuBLAS",
                          stacklevel=3)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = _CUBLAS_WORKSPACE
    fill = torch.utils.deterministic
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              fill.fill_uninitialized_memory, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    fill.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        fill.fill_uninitialized_memory = before[2]
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[3], before[4]
