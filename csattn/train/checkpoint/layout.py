"""A run's checkpoints on disk: ``<output>/checkpoint-<step>/`` and ``<output>/latest``, the trainer state file, the
move-aside of a damaged or incomplete checkpoint before a save overwrites its step, and ``--keep-last``."""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

from .manifest import INCOMPLETE, discard_manifest, from_rank0, verify_checkpoint
from .safe_state import load_state, save_state

__all__ = ["STATE_NAME", "LEGACY_STATE_NAME", "LATEST", "checkpoint_dir", "list_checkpoints", "mark_latest",
           "prepare_checkpoint_dir", "prune_checkpoints", "read_trainer_state", "write_trainer_state",
           "legacy_error"]

STATE_NAME = "trainer_state.safetensors"
LEGACY_STATE_NAME = "trainer_state.pt"  # a pickle, written by csattn before DCP checkpoints: never read
LATEST = "latest"


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


def read_trainer_state(path: str) -> dict[str, Any]:
    """The trainer state of checkpoint ``path`` (not its weights: a resuming run checks its options against
    the state's ``train_config`` first, since other data options also explain other weight shapes). Runs no code
    from the file; a pickle-era checkpoint raises ``ValueError`` saying what to do instead."""
    if why := legacy_error(path):
        raise ValueError(why)
    return load_state(os.path.join(path, STATE_NAME))


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
