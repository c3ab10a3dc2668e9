"""Training checkpoints, in one place: the model and optimizer state as DCP shards (``csattn.parallel.checkpoint``,
the mechanics) plus ``trainer_state.safetensors`` (LR schedule, step, every data stream's position, RNG states, the
mesh and the run's options), so a resumed run, on the same mesh or another, reproduces the next step exactly.

Layout (:mod:`.layout`): ``<output>/checkpoint-<step>/{dcp/, trainer_state.safetensors, manifest.json}`` (and
``adapter/`` with LoRA, the HF-format ``config.json`` + safetensors when the run exports them, the tokenizer's files
with ``--tokenizer``) and ``<output>/latest`` naming the newest complete checkpoint. ``manifest.json``
(:mod:`.manifest`: every file's size and sha256) is written last: a checkpoint without one is incomplete, one whose
files differ from it is damaged, and neither is ever resumed (``--resume auto`` takes the newest intact one), counted
by ``--keep-last`` nor saved into (a save moves it aside to ``.damaged`` / ``.incomplete``).

Saving: :mod:`.save`; resuming: :mod:`.resume`. The trainer state is tensors (safetensors) plus JSON
(:mod:`.safe_state`): opening a checkpoint from elsewhere runs no code. A checkpoint of csattn's pickle era (a
``trainer_state.pt``, before DCP) is refused with one line saying what to do.
"""

from .layout import LATEST, STATE_NAME, checkpoint_dir, list_checkpoints, prune_checkpoints, read_trainer_state
from .manifest import MANIFEST, verify_checkpoint
from .resume import Resume, compare_resume_config, find_resume, resolve_resume, restore
from .save import Checkpointer, save_checkpoint

__all__ = ["LATEST", "MANIFEST", "STATE_NAME", "Checkpointer", "Resume", "checkpoint_dir", "compare_resume_config",
           "find_resume", "list_checkpoints", "prune_checkpoints", "read_trainer_state", "resolve_resume", "restore",
           "save_checkpoint", "verify_checkpoint"]
