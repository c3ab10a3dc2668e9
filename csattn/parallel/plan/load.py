"""The model config the planner plans for, read from an HF ``config.json`` (:func:`load_config`)."""

from __future__ import annotations

import json
import os

from ...models.deepseek_v4.config import DeepseekV4ModelConfig

__all__ = ["load_config"]


def load_config(path: str) -> DeepseekV4ModelConfig:
    """The model config of an HF ``config.json`` (or a checkpoint directory holding one); ``ValueError`` naming
    ``--config`` when it is missing, unreadable or not a DeepSeek-V4 config."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as fh:
            data = json.load(fh)
        return DeepseekV4ModelConfig.from_hf(data)
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {path}: not JSON ({e})") from None
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise ValueError(f"--config {path}: not a DeepSeek-V4 HF config.json ({e})") from None
