"""Per-step metrics of a run: the losses kept for the result, tokens/s and MFU over the last steps, the log lines,
the progress bar, the JSON-lines file, TensorBoard scalars and the loss plot (rank 0 writes)."""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections import deque
from typing import Any

import torch

from ..models.deepseek_v4 import DeepseekV4ModelConfig
from ..models.deepseek_v4.flops import finetune_flops, peak_flops
from ..parallel import Meshes
from ..parallel.plan import flop_counts as plan_flop_counts
from ..parallel.plan import training_spec
from .errors import TrainWarning, UserError
from .packer import PackedBatch

__all__ = ["RunMetrics", "flop_counts", "metrics_file", "summary_writer", "loss_history", "plot_losses", "BOARD_TAGS",
           "RATE_WINDOW"]

RATE_WINDOW = 20  # steps over which tokens/s and MFU are reported


def flop_counts(cfg: Any, model_cfg: DeepseekV4ModelConfig) -> dict[str, float]:
    """:func:`~csattn.models.deepseek_v4.flops.finetune_flops`'s counts for the run's options, by the planner's
    parameter groups (:func:`csattn.parallel.plan.flop_counts`; the FP8 part only with ``--base-precision fp8``:
    the weight-only base multiplies in bf16). All zero when everything trains."""
    t = training_spec(lora_rank=cfg.lora_rank, lora_targets=cfg.lora_targets, train=cfg.train_groups,
                      freeze=cfg.freeze_groups, base_precision=cfg.base_precision, fp8_linears=cfg.fp8_linears)
    return plan_flop_counts(model_cfg, t, fp8_held=cfg.base_precision == "fp8")


class RunMetrics:
    """What a run reports of its steps from ``start`` on: :meth:`begin_step` before a step, :meth:`record` after it,
    :meth:`say` for a log line (rank 0, above the progress bar), :meth:`close` at the end, :meth:`plot` once the
    run ended well. ``resumed``: the metrics file drops its lines after ``start`` (the run does those steps again)."""

    def __init__(self, cfg: Any, model_cfg: DeepseekV4ModelConfig, meshes: Meshes, device: torch.device,
                 start: int, resumed: bool) -> None:
        self.cfg, self.model_cfg, self.dims, self.rank, self.device = cfg, model_cfg, meshes.dims, meshes.rank, device
        self.start = start
        self.losses: list[float] = []  # total loss (LM + MTP) of each step run here, of the global batch
        self.lm_losses: list[float] = []
        self.indexer_losses: list[float] = []
        self.bar = None
        if cfg.progress and self.rank == 0:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.steps, initial=start, desc="train", dynamic_ncols=True)
        self.peak = peak_flops(device, cfg.peak_tflops)
        self.counts = flop_counts(cfg, model_cfg)  # what a step runs: frozen weights have no weight gradient
        self.log = metrics_file(cfg, self.rank, start if resumed else None)
        self.board = summary_writer(cfg, self.rank, start)
        self.tokens, self.t0 = 0, time.perf_counter()
        # throughput over the last steps (the first steps also compile kernels: a rate since the start would
        # understate the steady state for hundreds of steps)
        self.recent: deque[tuple[float, int, float]] = deque([(self.t0, 0, 0.0)], maxlen=RATE_WINDOW + 1)

    def begin_step(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def record(self, step: int, metrics: dict[str, Any], batch: PackedBatch, lr: float) -> None:
        """Step ``step``'s global ``metrics`` (``train_step``'s), of this replica's ``batch``, at learning rate
        ``lr``: kept, then written to the file, TensorBoard, the bar and, every ``--log-every`` steps, a line."""
        self.losses.append(metrics["loss"])
        self.lm_losses.append(metrics["lm_loss"])
        self.indexer_losses.append(metrics["indexer_loss"])
        step_tokens = batch.num_tokens * self.dims.dp  # replicas hold the same number of rows, tokens may differ
        self.tokens += step_tokens
        tps, mfu, step_time = self._rates(step_tokens, batch)
        if self.log is not None or self.board is not None:
            rec = {"step": step, **metrics, "lr": lr, "tokens": step_tokens, "tokens_per_s": tps, "mfu": mfu,
                   "step_time": step_time, "time": time.time()}
            if self.device.type == "cuda":
                rec["peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            self._write(step, rec)
        shown = f"{mfu:.1%}" if self.peak else None
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", idx=f"{metrics['indexer_loss']:.3g}",
                                 tok_s=f"{tps:.0f}", **({"mfu": shown} if shown else {}))
        if step % self.cfg.log_every == 0:
            self.say(f"step {step}: loss {metrics['loss']:.4f} lm {metrics['lm_loss']:.4f} indexer "
                     f"{metrics['indexer_loss']:.4g} lr {lr:.3g} tok/s {tps:.0f}" + (f" MFU {shown}" if shown else ""))

    def _rates(self, step_tokens: int, batch: PackedBatch) -> tuple[float, float | None, float]:
        """Tokens/s and MFU over the last ``RATE_WINDOW`` steps (MFU None without a peak rate), and this step's time."""
        step_flops = 0.0
        if self.peak:
            f = finetune_flops(self.model_cfg, batch.packed.cu_seqlens, **self.counts)
            step_flops = (f["fwd"] + f["bwd"]) * self.dims.dp
        now = time.perf_counter()
        step_time = now - self.recent[-1][0]
        self.recent.append((now, step_tokens, step_flops))
        window = max(now - self.recent[0][0], 1e-9)
        steps = list(self.recent)[1:]  # recent[0] only marks the window's start time
        tps = sum(r[1] for r in steps) / window
        mfu = sum(r[2] for r in steps) / window / (self.peak * self.dims.world) if self.peak else None
        return tps, mfu, step_time

    def _write(self, step: int, rec: dict[str, Any]) -> None:
        if self.log is not None:
            self.log.write(json.dumps(rec) + "\n")
            self.log.flush()
        if self.board is not None:
            for key, value in rec.items():
                if key in BOARD_TAGS and value is not None:
                    self.board.add_scalar(BOARD_TAGS[key], value, step)

    def say(self, line: str) -> None:
        """One log line (rank 0), above the progress bar when there is one."""
        if self.rank != 0:
            return
        if self.bar:
            self.bar.write(line)
        else:
            print(line, flush=True)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(time.perf_counter() - self.t0, 1e-9)

    def close(self) -> None:
        for out in (self.bar, self.log, self.board):
            if out is not None:
                out.close()

    def plot(self) -> None:
        """``loss.png`` (rank 0, with ``--log-dir`` or ``--output``, when the run ran a step)."""
        if self.rank == 0 and (self.cfg.log_dir or self.cfg.output) and self.losses:
            plot_losses(self.cfg, self.start, self.losses, self.lm_losses, self.indexer_losses)


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
