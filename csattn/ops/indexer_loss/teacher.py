"""What the layer hands the sparse loss: the teacher's per-row results, filled one attention block at a time
(``SparseTeacher``), and the indexer queries as a recipe to recompute (``StudentQueries``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..backend import Backend

__all__ = ["SparseTeacher", "StudentQueries"]


class SparseTeacher:
    """Per-row teacher results of the sparse loss, filled one block of rows at a time while the attention
    forward has that block's ``q`` and ``lse`` (see ``csattn.layers.core``), so the loss never needs all of
    ``q [T, H, d]`` at once.

    ``mass [T, k]``: head-summed teacher masses (fp32, or fp64 for fp64 inputs; 0 where no id). The fused
    path also fills ``loss_rows [T]`` (the weighted per-row KL, its student computed in the same pass) and
    ``stats [T, 2]`` (student log-sum-exp and mass total) for its backward kernel.
    """

    def __init__(self, num_rows: int, topk: int, dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        self.mass = torch.zeros(num_rows, topk, dtype=dtype, device=device)
        self.loss_rows = torch.zeros(num_rows, dtype=dtype, device=device) if backend == "triton" else None
        self.stats = torch.zeros(num_rows, 2, dtype=dtype, device=device) if backend == "triton" else None
        self.geometry: tuple | None = None  # (H, d, dtype) of the attention queries, set by the fused path


class StudentQueries(NamedTuple):
    """The indexer queries as a recipe, so the loss can recompute them block by block in its backward instead of
    keeping ``q_idx [T, HI, cI]`` alive from the forward (512 MiB at 32k tokens for HI = 64, cI = 128, a third
    of a CSA layer's activations). ``fn(qr[lo:hi], cos[lo:hi], sin[lo:hi], *params)`` gives rows lo..hi of
    ``q_idx``; gradients reach those of ``params`` that require them (and ``qr`` if it does). ``chunk_rows``: rows
    per recomputed block of the fused backward (the layer's bound on the queries' temporaries)."""

    fn: Callable[..., Tensor]
    qr: Tensor  # [T, q_lora]
    cos: Tensor  # [T, rope / 2]
    sin: Tensor  # [T, rope / 2]
    # the indexer's q_b_proj.weight [HI cI, q_lora], then LoRA's pair a [r, q_lora], b [HI cI, r] where it has one
    params: tuple[Tensor, ...]
    chunk_rows: int
