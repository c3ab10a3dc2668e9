"""Training checkpoints: an HF-format model directory plus ``trainer_state.pt`` (optimizer, LR schedule,
step, every data-parallel packer position, RNG state), so a resumed run reproduces the next step exactly.

Layout: ``<output>/checkpoint-<step>/{config.json, model.safetensors, trainer_state.pt}`` and
``<output>/latest`` naming the newest complete checkpoint (written last, so a crash mid-save leaves the
previous one in place).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..models.deepseek_v4 import DeepseekV4ForCausalLM
from ..models.deepseek_v4.checkpoint import load_state_dict_into, read_safetensors, save_pretrained

__all__ = ["save_checkpoint", "load_checkpoint", "resolve_resume", "checkpoint_dir"]

STATE_NAME = "trainer_state.pt"
LATEST = "latest"


def checkpoint_dir(output: str, step: int) -> str:
    return os.path.join(output, f"checkpoint-{step:06d}")


def save_checkpoint(output: str, step: int, model: DeepseekV4ForCausalLM, state: dict[str, Any]) -> str:
    """Write checkpoint ``step`` (call on one rank) and point ``latest`` at it. Returns its directory."""
    path = checkpoint_dir(output, step)
    save_pretrained(model, path)
    tmp = os.path.join(path, STATE_NAME + ".tmp")
    torch.save({**state, "step": step}, tmp)
    os.replace(tmp, os.path.join(path, STATE_NAME))
    latest_tmp = os.path.join(output, LATEST + ".tmp")
    with open(latest_tmp, "w") as f:
        f.write(os.path.basename(path) + "\n")
    os.replace(latest_tmp, os.path.join(output, LATEST))
    return path


def resolve_resume(resume: str, output: str | None) -> str | None:
    """``"auto"`` -> the newest checkpoint under ``output`` (None if there is none); else the path itself."""
    if resume != "auto":
        if not os.path.isfile(os.path.join(resume, STATE_NAME)):
            raise ValueError(f"resume path {resume!r} has no {STATE_NAME}")
        return resume
    if output is None:
        raise ValueError("--resume auto needs --output")
    latest = os.path.join(output, LATEST)
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return os.path.join(output, f.read().strip())


def load_checkpoint(path: str, model: DeepseekV4ForCausalLM) -> dict[str, Any]:
    """Load the weights into ``model`` (errors name any missing / unexpected / misshaped tensor) and return
    the trainer state."""
    load_state_dict_into(model, read_safetensors(path))
    return torch.load(os.path.join(path, STATE_NAME), map_location="cpu", weights_only=False)
