"""Training checkpoints: the model and optimizer state as DCP shards (``csattn.parallel.checkpoint``) plus
``trainer_state.safetensors`` (LR schedule, step, every data stream's position, RNG states, the mesh and the
run's options), so a resumed run, on the same mesh or another, reproduces the next step exactly.

Layout: ``<output>/checkpoint-<step>/{dcp/, trainer_state.safetensors, manifest.json}`` (and the HF-format
``config.json`` + safetensors when the run exports them, the tokenizer's files with ``--tokenizer``) and
``<output>/latest`` naming the newest complete checkpoint. ``manifest.json`` (:mod:`.manifest`: every file's size
and sha256) is written last: a checkpoint without one is incomplete, one whose files differ from it is damaged,
and neither is ever resumed (``--resume auto`` takes the newest intact one) nor counted by ``--keep-last``.

The trainer state is tensors (safetensors) plus JSON (:mod:`.safe_state`): opening a checkpoint from
elsewhere runs no code. A checkpoint of csattn's pickle era (a ``trainer_state.pt``, before DCP) is refused with
one line saying what to do.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from typing import Any

from ..finetune.setup import resume_mismatch
from .manifest import INCOMPLETE, discard_manifest, from_rank0, verify_checkpoint
from .safe_state import load_state, save_state

__all__ = ["write_trainer_state", "mark_latest", "read_trainer_state", "legacy_error", "resolve_resume",
           "prune_checkpoints", "list_checkpoints", "prepare_checkpoint_dir", "checkpoint_dir", "compare_resume_config"]

STATE_NAME = "trainer_state.safetensors"
LEGACY_STATE_NAME = "trainer_state.pt"  # a pickle, written by csattn before DCP checkpoints: never read
LATEST = "latest"

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


def checkpoint_dir(output: str, step: int) -> str:
    return os.path.join(output, f"checkpoint-{step:06d}")


def write_trainer_state(path: str, step: int, state: dict[str, Any]) -> None:
    """``path/trainer_state.safetensors`` (call on one rank)."""
    os.makedirs(path, exist_ok=True)
    save_state(os.path.join(path, STATE_NAME), {**state, "step": step})


def legacy_error(path: str) -> str | None:
    """The one line to refuse checkpoint ``path`` with when it is of csattn's pickle era (a ``trainer_state.pt`` and
    no ``trainer_state.safetensors``: its trainer state is a pickle, which can run code, and its weights predate the
    DCP shards), else None."""
    if os.path.isfile(os.path.join(path, STATE_NAME)) or not os.path.isfile(os.path.join(path, LEGACY_STATE_NAME)):
        return None
    return (f"checkpoint {path} was written by an older csattn (a pickled {LEGACY_STATE_NAME}, before DCP "
            "checkpoints), which this csattn does not read: start a new run from its HF-format model files with "
            f"--init-from {path} (export them with the older csattn if it has none), or re-create the checkpoint")


def prepare_checkpoint_dir(path: str, rank: int) -> str | None:
    """Before a save writes checkpoint ``path`` (a collective under torch.distributed; rank 0 acts): an intact
    checkpoint already there is overwritten in place (its manifest removed first: it is incomplete until the new one
    is written); a damaged or incomplete one is moved aside to ``<path>.damaged`` or ``.incomplete`` (``-2``, ...),
    so none of its files enter the new checkpoint's manifest and nothing is deleted. Returns, on rank 0, a line
    saying where it went, else None."""
    if not from_rank0(os.path.isdir(path)):
        return None
    why = verify_checkpoint(path)  # hashes it (over the ranks): only when a run saves a step it saved before
    if rank != 0:
        return None
    if why is None:
        discard_manifest(path)
        return None
    kind = "incomplete" if why == INCOMPLETE else "damaged"
    aside, n = f"{path}.{kind}", 1
    while os.path.exists(aside):
        n += 1
        aside = f"{path}.{kind}-{n}"
    os.rename(path, aside)
    return f"moved the earlier {path} aside to {aside} before saving over it ({why})"


def mark_latest(output: str, path: str) -> None:
    """Point ``output/latest`` at checkpoint ``path`` (atomically; call once every rank has written)."""
    latest_tmp = os.path.join(output, LATEST + ".tmp")
    with open(latest_tmp, "w") as f:
        f.write(os.path.basename(path) + "\n")
    os.replace(latest_tmp, os.path.join(output, LATEST))


def list_checkpoints(output: str) -> list[str]:
    """The ``checkpoint-<step>`` directories under ``output``, oldest first (whatever their state)."""
    if not os.path.isdir(output):
        return []
    found = sorted((int(m.group(1)), name) for name in os.listdir(output)
                   if (m := re.fullmatch(r"checkpoint-(\d+)", name)) and os.path.isdir(os.path.join(output, name)))
    return [os.path.join(output, name) for _, name in found]


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


def read_trainer_state(path: str) -> dict[str, Any]:
    """The trainer state of checkpoint ``path`` (not its weights: a resuming run checks its options against
    the state's ``train_config`` first, since other data options also explain other weight shapes). Runs no code
    from the file; a pickle-era checkpoint raises ``ValueError`` saying what to do instead."""
    if why := legacy_error(path):
        raise ValueError(why)
    return load_state(os.path.join(path, STATE_NAME))


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


def prune_checkpoints(output: str, keep: int) -> list[str]:
    """Remove the intact checkpoints under ``output`` older than its newest ``keep`` intact ones. Returns the removed
    paths. A damaged or incomplete checkpoint never counts as one of them and is never removed, nor is the one
    ``latest`` names. This process alone checks (no collective): sizes only, against each manifest (no file is
    read: a save hashes its checkpoint once, a resume again); a truncated or missing file or manifest is found."""
    if keep < 1:
        return []
    latest = None
    if os.path.isfile(os.path.join(output, LATEST)):
        with open(os.path.join(output, LATEST)) as f:
            latest = os.path.join(output, f.read().strip())
    intact = [p for p in reversed(list_checkpoints(output))
              if verify_checkpoint(p, deep=False, collective=False) is None]
    removed = []
    for path in intact[keep:]:
        if path != latest:
            shutil.rmtree(path)
            removed.append(path)
    return removed
