"""The proxy through ``csattn train`` on one GPU and on meshes of gloo ranks sharing it, beside the planner's
per-rank peak predicted before launch.

    python -m benchmarks.sharded --json sharded.json

Runs, each a ``csattn train`` process (``torchrun`` for several ranks) on the 4-layer V4-Flash proxy in bf16:
world size 1 at 16k and 128k tokens (throughput, MFU, and the one-GPU peaks the planner predicts), then
4 sequences of 8k as one process and over dp_shard 2 x ep 2 and dp_shard 2 x cp 2 x ep 2 gloo ranks. Ranks
sharing one GPU measure memory per rank and that the meshes run with the fused kernels, not scaling: their
tokens/s is the gloo transport's. The JSON is rewritten after every run, so a run cut short keeps the others.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

from csattn.parallel.mesh import ParallelDims
from csattn.parallel.plan import load_config, plan

CONFIG = "benchmarks/configs/v4_flash_proxy.json"
TRAIN = ("--config-json", CONFIG, "--device", "cuda", "--dtype", "bfloat16", "--lr", "3e-4", "--min-lr", "3e-5",
         "--warmup-steps", "20", "--doc-min-len", "256", "--doc-max-len", "8192", "--no-progress", "--log-every", "20",
         "--export-hf", "never")
GLOO = ("--batch-seqs", "4", "--dist-backend", "gloo", "--dist-timeout", "120")


@dataclass(frozen=True)
class Run:
    """One ``csattn train`` run: its label, mesh sizes, tokens per sequence, steps and extra flags."""

    mesh: str
    ranks: int
    seq_len: int
    steps: int
    dims: dict[str, int]
    extra: tuple[str, ...] = ()
    timeout_s: int = 150

    @property
    def batch_seqs(self) -> int:
        return int(self.extra[self.extra.index("--batch-seqs") + 1]) if "--batch-seqs" in self.extra else 1


RUNS = (
    Run("world 1", 1, 16384, 40, {}),
    Run("world 1, 128k", 1, 131072, 3, {}, timeout_s=100),
    Run("one process, 4 x 8k (gloo reference)", 1, 8192, 3, {}, GLOO, 60),
    Run("dp_shard 2 x ep 2 (gloo, one GPU)", 2, 8192, 3, {"dp_shard": 2, "ep": 2}, GLOO),
    Run("dp_shard 2 x cp 2 x ep 2 (gloo, one GPU)", 4, 8192, 3, {"dp_shard": 2, "cp": 2, "ep": 2}, GLOO),
)


def planned_gib(run: Run) -> float:
    """The planner's per-rank peak for ``run`` (no recompute, bf16), in GiB."""
    dims = ParallelDims(world=run.ranks, **run.dims)
    p = plan(load_config(CONFIG), dims, run.seq_len, batch_seqs=run.batch_seqs, recompute="none")
    return round(p.peak / 2**30, 2)


def measure(run: Run) -> dict:
    """Launch ``run`` and summarize rank 0's metrics: the last window's tokens/s and MFU, the largest step peak."""
    record = {"mesh": run.mesh, "ranks": run.ranks, "tokens": run.seq_len * run.batch_seqs,
              "planned_gib": planned_gib(run)}
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in run.dims.items()]
        args = [*TRAIN, *run.extra, *flags, "--seq-len", str(run.seq_len), "--steps", str(run.steps),
                "--metrics", metrics]
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                    str(run.ranks)] if run.ranks > 1 else [sys.executable]
        try:
            rc = subprocess.run([*launcher, "-m", "csattn", "train", *args], timeout=run.timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        recs = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    if rc != 0 or not recs:
        return {**record, "error": f"rc {rc}"}
    peaks = [r["peak_gib"] for r in recs if r.get("peak_gib") is not None]
    return {**record, "tokens_per_s": recs[-1].get("tokens_per_s"), "mfu": recs[-1].get("mfu"),
            "peak_gib": max(peaks) if peaks else None, "losses": [r["loss"] for r in recs[:3]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="the output file")
    ap.add_argument("--commit", default=os.environ.get("CSATTN_COMMIT", "?"), help="the commit measured")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    meta = {"device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "commit": args.commit, "command": "python -m benchmarks.sharded",
            "note": "tokens_per_s / mfu: csattn train's last 20-step window; gloo ranks share one GPU, so their "
                    "speed is the gloo transport's, not a scaling figure; planned_gib: csattn plan before launch"}
    out = {"meta": meta, "results": []}
    for run in RUNS:
        print(f"[sharded] {run.mesh}: {run.ranks} rank(s), {run.seq_len} tokens x {run.batch_seqs}", flush=True)
        out["results"].append(measure(run))
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
