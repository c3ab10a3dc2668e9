"""Tasks the sharded-training tests run on every rank of a gloo pool (importable, so spawned ranks find them)."""

from __future__ import annotations

from typing import Any

import torch

from csattn.parallel import full_grads, full_state_dict
from csattn.train.loop import TrainConfig, train

# fp64, 3 AdamW steps of the tiny model (W / CSA / HCA layers, hash + learned MoE, shared expert, MTP) on packs
# whose documents cross rank boundaries; 4 packed sequences of 64 rows per step on every mesh
BASE = dict(steps=3, seq_len=64, device="cpu", progress=False, warmup_steps=1, dtype="float64", batch_seqs=4,
            pad_multiple=4)


def train_task(group: Any, **kwargs: Any) -> dict[str, Any] | None:
    """``train`` on the pool's ranks; rank 0 returns the losses, the final weights and the last step's gradients."""
    torch.set_num_threads(1)
    result = train(TrainConfig(**{**BASE, **kwargs}))
    state = full_state_dict(result.model, result.meshes)
    grads = full_grads(result.model, result.meshes)
    if result.meshes.rank:
        return None
    return {"losses": result.losses, "indexer": result.indexer_losses, "state": state, "grads": grads}


def reference(**kwargs: Any) -> dict[str, Any]:
    """The same run in this process (world size 1)."""
    from csattn.parallel import Meshes, ParallelDims

    result = train(TrainConfig(**{**BASE, **kwargs}))
    meshes = Meshes(ParallelDims().resolve())
    return {"losses": result.losses, "indexer": result.indexer_losses,
            "state": full_state_dict(result.model, meshes), "grads": full_grads(result.model, meshes)}
