"""Resuming: which checkpoint (``--resume DIR`` verified against its manifest, or ``--resume auto``: the newest intact
one under ``--output``, each newer damaged or incomplete one named and skipped), its options against this run's,
and the restore of the weights, optimizer, LR schedule, data position and RNG states from it, on any mesh."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ...finetune.setup import resume_mismatch
from ...parallel import load_sharded
from ...parallel.checkpoint import DCP_DIR
from ..config import TrainConfig
from ..errors import TrainWarning, user_errors
from ..step import TrainState
from .layout import STATE_NAME, legacy_error, list_checkpoints, read_trainer_state
from .manifest import INCOMPLETE, from_rank0, verify_checkpoint

__all__ = ["Resume", "find_resume", "restore", "resolve_resume", "compare_resume_config", "DATA_OPTIONS",
           "SCHEDULE_OPTIONS"]

# options that decide which documents the saved packer position points into (the corpus and its order):
# resuming with another value would continue from a position in a different stream
DATA_OPTIONS = ("data", "seed", "text_path", "doc_min_len", "doc_max_len", "data_path", "text_field", "tokenizer")
# the --data kinds an option matters for (the others ignore it); options not named here matter for every kind.
# jsonl / parquet are read in file order, so the seed does not change their stream.
_STREAMED = ("jsonl", "parquet")
_DATA_ONLY_FOR = {"seed": ("synthetic", "pysrc", "text"), "text_path": ("text",), "doc_min_len": ("synthetic",),
                  "doc_max_len": ("synthetic",), "data_path": _STREAMED, "text_field": _STREAMED,
                  "tokenizer": _STREAMED}
# options that shape the LR schedule: resuming with another value gives a different LR from the next step on
SCHEDULE_OPTIONS = ("steps", "warmup_steps", "lr", "min_lr")


@dataclass(frozen=True)
class Resume:
    """The verified checkpoint a run continues (``path``) and its trainer state (``state``: step, LR schedule, data
    position, RNG states, mesh, the options it was trained with)."""

    path: str
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


def find_resume(cfg: TrainConfig, rank: int) -> Resume | None:
    """The checkpoint ``--resume`` names, verified (a collective), with its trainer state, its options compared with
    these (raises on other data options, before the weights: another --tokenizer also changes the vocab shape; rank 0
    warns once of the others); None to start at step 0."""
    path = _resume_path(cfg, rank)
    if path is None:
        return None
    state = read_trainer_state(path)
    notes = compare_resume_config(path, state.get("train_config"), asdict(cfg))
    if rank == 0:
        for note in notes:
            warnings.warn(note, TrainWarning, stacklevel=3)
    return Resume(path, state)


def _resume_path(cfg: TrainConfig, rank: int) -> str | None:
    """The checkpoint to resume (:func:`resolve_resume`); None: start at step 0, said aloud when ``--resume auto``
    found no intact one. Each damaged or incomplete checkpoint it skipped is named in a line."""
    if not cfg.resume:
        return None
    skipped: list[str] = []  # a line for each damaged or incomplete checkpoint --resume auto passed over
    resume = resolve_resume(cfg.resume, cfg.output, skipped.append)
    if rank == 0:
        for line in skipped:
            print(line, flush=True)
        if resume is None:
            intact = " intact" if skipped else ""
            print(f"--resume auto: no{intact} checkpoint under {cfg.output}: starting from step 0", flush=True)
    return resume


def restore(state: TrainState, reader: Any, resume: Resume) -> int:
    """Load ``resume``'s DCP shards into the model and optimizer (a collective; any mesh), its LR schedule, its data
    position into ``reader`` and this rank's RNG state; returns the step to continue from."""
    saved, rank = resume.state, state.meshes.rank
    with user_errors():  # a checkpoint of another model config names the tensor
        if not os.path.isdir(os.path.join(resume.path, DCP_DIR)):
            raise ValueError(f"checkpoint {resume.path} has no {DCP_DIR}/ (sharded model and optimizer state): it was "
                             f"written by an older csattn; start a new run from its weights with --init-from "
                             f"{resume.path}")
        load_sharded(resume.path, state.model, state.optimizer, state.meshes)
    if rank == 0:
        print(f"resuming from {resume.path} at step {resume.step}", flush=True)
    state.scheduler.load_state_dict(saved["scheduler"])
    with user_errors():
        reader.load_state_dict(saved["packers"])
    rngs = saved["rng"] if isinstance(saved["rng"], list) else [saved["rng"]]
    torch.set_rng_state(rngs[rank] if len(rngs) == state.meshes.dims.world else rngs[0])
    return resume.step


def resolve_resume(resume: str, output: str | None, warn: Callable[[str], None] | None = None) -> str | None:
    """The checkpoint to resume, verified against its manifest (a collective under torch.distributed: every rank
    gets the same answer).

    ``"auto"``: the newest intact checkpoint under ``output`` (None if there is none); each newer damaged or
    incomplete one is skipped, named with why in one ``warn`` line. A directory: itself, once verified; a damaged,
    incomplete or pickle-era one raises ``ValueError`` naming what is wrong and what to do.
    """
    say = warn or (lambda line: None)
    if resume != "auto":
        if why := legacy_error(resume):
            raise ValueError(why)
        if not os.path.isfile(os.path.join(resume, STATE_NAME)):
            raise ValueError(f"--resume {resume!r} has no {STATE_NAME}: pass a checkpoint-<step> directory "
                             "written by csattn train, or --resume auto with --output")
        return _verified(resume)
    if output is None:
        raise ValueError("--resume auto needs --output (the run directory whose latest checkpoint to resume)")
    for path in reversed(from_rank0(list_checkpoints(output))):
        why = verify_checkpoint(path)
        if why is None:
            return path
        hint = f" ({legacy_error(path)})" if why == INCOMPLETE and legacy_error(path) else ""
        say(f"csattn train: warning: --resume auto: skipping {path}: {why}{hint}")
    return None


def _verified(path: str) -> str:
    why = verify_checkpoint(path)
    if why is None:
        return path
    if why == INCOMPLETE:
        raise ValueError(f"--resume {path!r} is incomplete: {why}. Resume another checkpoint (--resume auto with "
                         "--output takes the newest intact one)")
    raise ValueError(f"--resume {path!r} is damaged: {why}. Resume another checkpoint (--resume auto with --output "
                     "takes the newest intact one)")


def compare_resume_config(path: str, saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """Check this run's options against the resumed checkpoint's ``train_config``.

    Raises ``ValueError`` naming the option when a data option differs (the saved packer position would
    point into another document stream). Returns warnings for LR-schedule options that differ: the schedule
    is this run's (a longer ``--steps`` stretches the cosine decay from the resumed step on), except that the
    peak LR stays the checkpoint's (the scheduler state restores it).
    """
    if not saved:
        return []
    mismatch = resume_mismatch(saved, current)  # LoRA and frozen groups: the saved state has their shapes
    if mismatch:
        raise ValueError(f"{path}: {mismatch}")
    changed = [k for k in DATA_OPTIONS if k in saved and k in current and _norm(saved[k]) != _norm(current[k])
               and current.get("data") in _DATA_ONLY_FOR.get(k, (current.get("data"),))]
    if changed:
        what = ", ".join(f"--{k.replace('_', '-')} {current[k]!r} (checkpoint: {saved[k]!r})" for k in changed)
        raise ValueError(
            f"resuming {path} with other data options than it was trained with: {what}. The saved data position "
            "belongs to the checkpoint's stream: pass the checkpoint's values to continue it, or start a new "
            "run from its weights with --init-from " + path + " (fresh optimizer and data position).")
    notes = []
    for k in SCHEDULE_OPTIONS:
        if k in saved and k in current and saved[k] != current[k]:
            flag = f"--{k.replace('_', '-')}"
            if k == "lr":
                notes.append(f"{flag} {current[k]} differs from the checkpoint's {saved[k]}: the resumed run keeps "
                             f"the checkpoint's peak LR {saved[k]} (restored with the scheduler state)")
            else:
                notes.append(f"{flag} {current[k]} differs from the checkpoint's {saved[k]}: the LR schedule from "
                             f"the resumed step on follows {flag} {current[k]}, so the LR differs from what the "
                             "original run would have used")
    return notes


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
