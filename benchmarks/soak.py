"""Soak test of ``csattn train``: one run killed (SIGKILL) and resumed ``--kills`` times against two uninterrupted
runs of the same options, all three side by side on one GPU, for ``--seconds`` of wall time.

The GPU backward accumulates some gradients with fp32 atomics (``ops/sparse_attn``, ``ops/indexer_loss``), so
two uninterrupted runs are not bitwise equal: the second one measures that noise, and the killed run must
differ from the first no more than the second does (losses per step, final weights). With ``--deterministic`` among
the train options all three must be bitwise equal (``bitwise_equal_losses`` and ``bitwise_equal_weights``). Memory
must stay flat: the per-step allocator peak of the uninterrupted run, after its first steps, within a few MiB.

    python -m benchmarks.soak --seconds 540 --kills 2 --out /tmp/soak --json soak.json -- \\
        --config-json benchmarks/configs/v4_flash_proxy.json --device cuda --dtype bfloat16 --seq-len 8192 \\
        --steps 400 --log-every 25
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import torch


def _train(args: list[str], out: str, log: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "csattn", "train", *args, "--output", out, "--resume", "auto", "--no-progress"]
    return subprocess.Popen(cmd, stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)


def _last_per_step(path: str) -> dict[int, dict]:
    out: dict[int, dict] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                out[rec["step"]] = rec  # a step re-run after a resume: the resumed value counts
    return out


def _weights(run: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    with open(os.path.join(run, "latest")) as f:
        ckpt = os.path.join(run, f.read().strip())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(ckpt)):
        if name.endswith(".safetensors") and name.startswith("model"):
            tensors.update(load_file(os.path.join(ckpt, name)))
    return tensors


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k].double() - b[k].double()).square().sum()) for k in b if b[k].is_floating_point())
    den = sum(float(b[k].double().square().sum()) for k in b if b[k].is_floating_point())
    return (num / max(den, 1e-300)) ** 0.5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=540, help="wall-time budget of the three runs")
    p.add_argument("--kills", type=int, default=2)
    p.add_argument("--out", default="/tmp/csattn-soak")
    p.add_argument("--json", default=None)
    p.add_argument("--commit", default=None, help="the commit recorded in the JSON (default: git rev-parse)")
    p.add_argument("--save-every", type=int, default=25, help="checkpoint cadence of the killed run")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: the csattn train options")
    a = p.parse_args()
    train_args = [x for x in a.train_args if x != "--"]
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    runs = {name: os.path.join(a.out, name) for name in ("uninterrupted", "again", "killed")}
    logs = {name: path + ".log" for name, path in runs.items()}
    t0 = time.time()
    # only the killed run needs intermediate checkpoints (the others save their final step): the three runs
    # differ in nothing else
    killed_args = train_args + ["--save-every", str(a.save_every), "--keep-last", "1"]
    args_of = {"uninterrupted": train_args, "again": train_args, "killed": killed_args}
    procs = {name: _train(args_of[name], runs[name], logs[name]) for name in runs}
    kills = []
    # kill the third run at even fractions of its steps, one step past them, so work since its last checkpoint
    # is lost and redone (a step count that is not a multiple of --save-every)
    steps = int(train_args[train_args.index("--steps") + 1])
    marks = [steps * (i + 1) // (a.kills + 1) + 1 for i in range(a.kills)]
    while any(proc.poll() is None for proc in procs.values()) and time.time() - t0 < a.seconds:
        done = max(_last_per_step(os.path.join(runs["killed"], "metrics.jsonl")) or [0])
        if marks and done >= marks[0] and procs["killed"].poll() is None:
            marks.pop(0)
            os.killpg(procs["killed"].pid, signal.SIGKILL)
            procs["killed"].wait()
            kills.append({"after_s": round(time.time() - t0, 1), "last_step_logged": done})
            procs["killed"] = _train(killed_args, runs["killed"], logs["killed"])
        time.sleep(0.2)
    for name, proc in procs.items():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            raise SystemExit(f"{name} did not finish within --seconds {a.seconds}: see {logs[name]}")
        if proc.returncode:
            raise SystemExit(f"{name} failed with exit code {proc.returncode}: see {logs[name]}")
    m = {name: _last_per_step(os.path.join(path, "metrics.jsonl")) for name, path in runs.items()}
    steps = sorted(m["uninterrupted"])
    if sorted(m["killed"]) != steps or sorted(m["again"]) != steps:
        raise SystemExit("the runs logged different steps")

    def loss_diff(name: str) -> float:
        return max(abs(m[name][s]["loss"] - m["uninterrupted"][s]["loss"]) / abs(m["uninterrupted"][s]["loss"])
                   for s in steps)

    w = {name: _weights(path) for name, path in runs.items()}
    peaks = [m["uninterrupted"][s].get("peak_gib") for s in steps[3:]]
    peaks = [x for x in peaks if x is not None]
    result = {
        "steps": len(steps), "wall_s": round(time.time() - t0, 1), "kills": kills, "train_args": train_args,
        "loss_first_last": [m["uninterrupted"][steps[0]]["loss"], m["uninterrupted"][steps[-1]]["loss"]],
        "max_rel_loss_diff": {"killed": loss_diff("killed"), "again": loss_diff("again")},
        "rel_weight_diff": {"killed": _rel(w["killed"], w["uninterrupted"]),
                            "again": _rel(w["again"], w["uninterrupted"])},
        "bitwise_equal_losses": {name: all(m[name][s]["loss"] == m["uninterrupted"][s]["loss"] for s in steps)
                                 for name in ("killed", "again")},
        "bitwise_equal_weights": {name: all(torch.equal(w[name][k], w["uninterrupted"][k]) for k in w[name])
                                  for name in ("killed", "again")},
        "peak_gib_min_max_after_step_3": [min(peaks), max(peaks)] if peaks else None,
        "tokens_per_s_last": m["uninterrupted"][steps[-1]].get("tokens_per_s"),
        "mfu_last": m["uninterrupted"][steps[-1]].get("mfu"),
    }
    print(json.dumps(result, indent=1))
    if a.json:
        from benchmarks.run import run_meta

        device = torch.device(train_args[train_args.index("--device") + 1] if "--device" in train_args else "cpu")
        with open(a.json, "w") as f:
            json.dump({"meta": run_meta(device, a.commit), "results": [result],
                       "metrics": {k: list(v.values()) for k, v in m.items()}}, f)


if __name__ == "__main__":
    main()
