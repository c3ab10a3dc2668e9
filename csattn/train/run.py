"""``train``: a run on PyTorch's distributed engine, phase by phase: build (``build.py``: mesh, model with its
fine-tuning choices, optimizer, data), resume (``checkpoint/``), then per step the step (``step.py``), its metrics
(``metrics.py``) and a checkpoint when one is due (``checkpoint/``). DCP checkpoints resume exactly on any mesh."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

from ..deterministic import deterministic_mode
from ..models.deepseek_v4 import DeepseekV4ForCausalLM
from ..parallel import Meshes
from .build import build, offload_hint, setup_distributed
from .checkpoint.resume import find_resume, restore
from .checkpoint.save import Checkpointer
from .config import TrainConfig
from .errors import user_errors
from .metrics import RunMetrics
from .step import BadSteps, train_step

__all__ = ["TrainConfig", "TrainResult", "train"]


@dataclass
class TrainResult:
    losses: list[float]  # total loss (LM + MTP) of each step run here, of the global batch
    lm_losses: list[float]
    indexer_losses: list[float]
    start_step: int
    model: DeepseekV4ForCausalLM  # sharded under a mesh: csattn.parallel.full_state_dict(model, meshes) gathers it
    tokens_per_second: float
    meshes: Meshes | None = None


def train(cfg: TrainConfig) -> TrainResult:
    """Run ``cfg.steps`` optimizer steps (counting any resumed ones). Works in one process or under torchrun.

    Raises :class:`UserError` on a mistake in the options, checkpoints or data files, and :class:`TrainingStopped`
    after ``max_bad_steps`` non-finite steps in a row or when the weights to save are not finite.

    ``cfg.deterministic`` turns torch's deterministic mode on for the run (:func:`csattn.deterministic_mode`, before
    any CUDA work) and gives the model's kernels fixed-point sums: two runs, or a run killed and resumed, give the
    same bits on the same GPU and software. The process's previous mode is restored at the end."""
    cfg.validate()
    with deterministic_mode() if cfg.deterministic else nullcontext():
        return run(cfg)


def run(cfg: TrainConfig) -> TrainResult:
    """The run loop. The next batch is built on the host while the device runs the step; a checkpoint of a step
    holds the readers' position before that next batch."""
    with user_errors():
        meshes, device = setup_distributed(cfg)
    offload_hint(cfg, device, meshes.rank)
    with user_errors():  # the checkpoint to resume, its options against these
        resume = find_resume(cfg, meshes.rank)
    trainer = build(cfg, meshes, device, resume.state if resume else None)
    state, reader = trainer.state, trainer.reader
    start = restore(state, reader, resume) if resume else 0
    metrics = RunMetrics(cfg, trainer.state.model.config, meshes, device, start, resumed=resume is not None)
    saver = Checkpointer(cfg, trainer.reader.batch_seqs, trainer.tokenizer)
    bad = BadSteps(cfg.max_bad_steps, cfg.output)
    with user_errors():  # the data files
        batch = next(reader) if start < cfg.steps else None
    try:
        for step in range(start + 1, cfg.steps + 1):
            metrics.begin_step()
            finish = train_step(state, batch, saver.late())  # launched: the host reads the next batch meanwhile
            consumed = reader.state_dict()
            with user_errors():
                upcoming = next(reader) if step < cfg.steps else None
            done = finish()
            save_due = done.pop("save_due")  # any rank's clock: every rank saves at the same step
            metrics.record(step, done, batch, state.scheduler.get_last_lr()[0])
            bad.check(step, done["nonfinite"], metrics.say)
            saver.after_step(state, step, consumed, save_due)
            batch = upcoming
    finally:
        metrics.close()
    metrics.plot()
    return TrainResult(metrics.losses, metrics.lm_losses, metrics.indexer_losses, start, state.model,
                       metrics.tokens_per_second, meshes)
