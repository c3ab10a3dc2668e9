"""Per-step metrics of a run: the JSON-lines file, TensorBoard scalars, the loss plot, the MFU's peak rate."""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any

from .errors import TrainWarning, UserError

__all__ = ["metrics_file", "summary_writer", "loss_history", "plot_losses", "BOARD_TAGS"]


def metrics_file(cfg: Any, rank: int, resumed_step: int | None = None) -> Any:
    """Rank 0's JSON-lines metrics file (appended to, so a resumed run continues it), or None. Resumed at
    ``resumed_step``, the lines of later steps are dropped first: the run does those steps again, and the file
    then holds each step once, as the weights in the checkpoints saw it."""
    path = cfg.metrics or (os.path.join(cfg.output, "metrics.jsonl") if cfg.output else None)
    if path is None or rank != 0:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if resumed_step is not None and os.path.isfile(path):
        _truncate_after(path, resumed_step)
    return open(path, "a")


def _truncate_after(path: str, step: int) -> None:
    """Rewrite the metrics file keeping the lines of steps <= ``step`` (atomically: a temporary file, then a
    rename); lines that do not parse are kept, in place."""
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            later = int(json.loads(line)["step"]) > step
        except (ValueError, KeyError, TypeError):
            later = False
        if not later:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)


# TensorBoard tag of each per-step metrics record field
BOARD_TAGS = {"loss": "loss/total", "lm_loss": "loss/lm", "mtp_loss": "loss/mtp", "indexer_loss": "loss/indexer",
               "lr": "optim/lr", "grad_norm": "optim/grad_norm", "tokens_per_s": "perf/tokens_per_s",
               "mfu": "perf/mfu", "peak_gib": "perf/peak_gib"}


def summary_writer(cfg: Any, rank: int, start: int) -> Any:
    """Rank 0's TensorBoard writer for ``--log-dir``, or None."""
    if not cfg.log_dir or rank != 0:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise UserError("--log-dir needs the tensorboard package: pip install 'csattn[data]' (or tensorboard)") from e
    # resumed: TensorBoard drops what earlier event files hold from step start + 1 on (the steps are run again)
    return SummaryWriter(cfg.log_dir, purge_step=start + 1 if start else None, flush_secs=30)


def _last_per_step(path: str) -> dict[int, dict[str, Any]]:
    """The metrics file's records by step; a step logged again (resumed after it) keeps its last record."""
    records: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                records[int(rec["step"])] = rec
    return records


def loss_history(cfg: Any, start: int, losses: list[float], lm: list[float],
                 idx: list[float]) -> tuple[list[int], dict[str, list[float]]]:
    """Steps and losses of every step so far: from the metrics file when there is one (it holds the steps of
    earlier runs this one resumed; a step run again keeps its last value), else this run's own."""
    path = cfg.metrics or (os.path.join(cfg.output, "metrics.jsonl") if cfg.output else None)
    if path and os.path.isfile(path):
        records = {s: r for s, r in _last_per_step(path).items() if s <= start + len(losses)}
        steps = sorted(records)
        return steps, {k: [math.nan if records[s].get(k) is None else records[s][k] for s in steps]
                       for k in ("loss", "lm_loss", "mtp_loss", "indexer_loss")}
    return list(range(start + 1, start + len(losses) + 1)), {"loss": losses, "lm_loss": lm, "indexer_loss": idx}


def plot_losses(cfg: Any, start: int, losses: list[float], lm: list[float], idx: list[float]) -> None:
    """``<log-dir or output>/loss.png``: the curves of :func:`loss_history`."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed: a file only
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("no loss.png: matplotlib is not installed (pip install 'csattn[data]')", TrainWarning,
                      stacklevel=2)
        return
    steps, series = loss_history(cfg, start, losses, lm, idx)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for key in ("loss", "lm_loss", "mtp_loss"):
        if key in series:
            top.plot(steps, series[key], label=key)
    top.set_ylabel("loss")
    top.legend()
    top.grid(alpha=0.3)
    bottom.plot(steps, series["indexer_loss"], color="tab:red", label="indexer_loss (KL)")
    bottom.set_xlabel("step")
    bottom.set_ylabel("indexer loss")
    bottom.legend()
    bottom.grid(alpha=0.3)
    out_dir = cfg.log_dir or cfg.output
    os.makedirs(out_dir, exist_ok=True)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=100)
    plt.close(fig)
