"""Saving: when a checkpoint is due (the final step with ``--output``, ``--save-every``, ``--save-every-minutes``)
and what a save writes, in order: the DCP shards of the model and optimizer, ``adapter/`` with LoRA, the HF-format
model when ``--export-hf`` asks, the tokenizer's files, the trainer state, the manifest (last: the checkpoint is
complete once it is there), ``latest``; then ``--keep-last`` prunes. Non-finite weights are never written."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from ...finetune.setup import export_merged, save_adapters
from ...models.deepseek_v4 import DeepseekV4ForCausalLM
from ...parallel import Meshes, save_sharded
from ..config import TrainConfig
from ..errors import TrainingStopped
from ..step import TrainState
from .layout import checkpoint_dir, mark_latest, prepare_checkpoint_dir, prune_checkpoints, write_trainer_state
from .manifest import gather_objects, write_manifest

__all__ = ["Checkpointer", "save_checkpoint"]


class Checkpointer:
    """The run's saving policy: :meth:`late` feeds a step this rank's clock, :meth:`after_step` saves when one is
    due (the same decision on every rank: the step's all-reduced ``save_due`` carries the clocks)."""

    def __init__(self, cfg: TrainConfig, batch_seqs: int, tokenizer: Any = None) -> None:
        self.cfg, self.batch_seqs, self.tokenizer = cfg, batch_seqs, tokenizer
        self.every_s = cfg.save_minutes * 60 if cfg.output else 0.0  # time-based checkpoints (0: none)
        self.saved_at = time.monotonic()

    def late(self) -> bool:
        """This rank's clock says a time-based checkpoint is due."""
        return bool(self.every_s) and time.monotonic() - self.saved_at >= self.every_s

    def after_step(self, state: TrainState, step: int, reader_state: dict[int, Any], late_anywhere: bool) -> None:
        """With ``--output`` the final step is always saved; ``--save-every`` and ``--save-every-minutes`` (any
        rank's clock: ``late_anywhere``) add the intermediate checkpoints."""
        cfg = self.cfg
        if cfg.output and (step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0) or late_anywhere):
            save_checkpoint(cfg, state, step, reader_state, self.batch_seqs, self.tokenizer)
            self.saved_at = time.monotonic()


def save_checkpoint(cfg: TrainConfig, state: TrainState, step: int, reader_state: dict[int, Any], batch_seqs: int,
                    tokenizer: Any = None) -> None:
    """Checkpoint ``step`` under ``cfg.output`` (a collective; the module's docstring says what it writes).
    ``reader_state``: this rank's data streams' positions before the step's next batch. Refuses non-finite weights
    before writing anything."""
    meshes, path = state.meshes, checkpoint_dir(cfg.output, step)
    if not _weights_finite(state.model, meshes):
        # a checkpoint of them would only resume into the same failure, and --keep-last would prune good ones
        raise TrainingStopped(
            f"step {step}: the model's weights hold NaN or inf values: refusing to save {path}; the checkpoints "
            f"already under {cfg.output} are kept. Resume from the latest (--resume auto) with a lower --lr, more "
            "--warmup-steps or a --grad-clip")
    moved = prepare_checkpoint_dir(path, meshes.rank)  # an earlier checkpoint of this step
    if moved:
        print(f"note: {moved}", flush=True)
    if meshes.distributed:
        dist.barrier()  # before any rank writes into path
    save_sharded(path, state.model, state.optimizer, meshes)
    trainer_state = _trainer_state(cfg, state, reader_state, batch_seqs)  # gathered from every rank
    save_adapters(state.model, path, meshes)  # adapter/ in PEFT's format, with LoRA
    if cfg.export_hf == "every" or (cfg.export_hf == "final" and step == cfg.steps):
        export_merged(state.model, path, meshes)  # the HF-format model, adapters merged
    if meshes.rank == 0:
        if tokenizer is not None:  # the checkpoint decodes and generates on its own (config.json has its ids)
            tokenizer.save_pretrained(path)
        write_trainer_state(path, step, trainer_state)
    if meshes.distributed:
        dist.barrier()  # every rank's shards are on disk before the manifest lists them
    write_manifest(path, step)  # last: the checkpoint is complete once it is there
    if meshes.rank == 0:
        _publish(cfg, path)
    if meshes.distributed:
        dist.barrier()


def _trainer_state(cfg: TrainConfig, state: TrainState, reader_state: dict[int, Any],
                   batch_seqs: int) -> dict[str, Any]:
    """What the DCP shards do not hold: the LR schedule, every data stream's position and every rank's RNG state
    (collectives), the mesh, the run's options and the model's training settings."""
    packers: list[Any] = [None] * batch_seqs
    for states in gather_objects(reader_state, state.meshes.dims.world):
        for s, st in states.items():
            packers[s] = st
    rngs = gather_objects(torch.get_rng_state(), state.meshes.dims.world)
    return {"scheduler": state.scheduler.state_dict(), "packers": packers, "rng": rngs, "batch_seqs": batch_seqs,
            "mesh": asdict(state.meshes.dims), "train_config": asdict(cfg),
            "model_training": state.model.config.training_dict()}


def _publish(cfg: TrainConfig, path: str) -> None:
    """Rank 0, once the checkpoint is complete: name it ``latest``, say so, then let ``--keep-last`` prune."""
    from tqdm import tqdm

    mark_latest(cfg.output, path)
    tqdm.write(f"saved checkpoint {path}")  # above any progress bar
    if cfg.keep_last:  # only now that the new checkpoint is complete and named latest
        for old in prune_checkpoints(cfg.output, cfg.keep_last):
            tqdm.write(f"removed checkpoint {old} (--keep-last {cfg.keep_last})")


def _weights_finite(model: DeepseekV4ForCausalLM, meshes: Meshes) -> bool:
    """Whether every weight (parameters and floating buffers: router biases) is finite on every rank: one MAX
    all-reduce of this rank's verdict on its shards, so every rank decides alike."""
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in (*model.parameters(), *model.buffers())]
    # FP8-held frozen codes (one byte) never change: checked once when read
    flags = [~torch.isfinite(t).all() for t in local if t.is_floating_point() and t.element_size() > 1 and t.numel()]
    bad = torch.stack(flags).any().float().reshape(1) if flags else torch.zeros(1)
    if meshes.distributed:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bad.item()


