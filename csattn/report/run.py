"""``csattn report``: memory and speed scaling of one CSA and one HCA layer over tokens, CP sizes, partitions
and paths; writes JSON, a Markdown table and PNG plots."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
import warnings

import torch
from tqdm import tqdm

from ..cp.launch import free_port, process
from .worker import Job, run_group, run_isolated

__all__ = ["add_report_args", "run_report", "plan_groups", "resolve_defaults", "GPU_DEFAULTS", "CPU_DEFAULTS"]


# The sizing options' defaults (None on the command line = these): sized for a GPU, or for a CPU smoke run
# (--geometry tiny off CUDA), where the GPU's 100-odd cases up to 128k tokens would run for hours.
GPU_DEFAULTS: dict[str, object] = dict(
    tokens=[4096, 8192, 16384, 32768, 65536, 131072], cp=[1, 2, 4], reference_max_tokens=32768, hf_max_tokens=8192,
    steps=3, model_tokens=[4096, 16384, 65536], model_routing=["8x2", "64x6"], hf_model_max_tokens=6144)
CPU_DEFAULTS: dict[str, object] = dict(
    tokens=[128, 256], cp=[1, 2], reference_max_tokens=256, hf_max_tokens=128, steps=1, model_tokens=[256],
    model_routing=["8x2"], hf_model_max_tokens=256)


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the sizing options left unset (None) from :data:`CPU_DEFAULTS` for ``--geometry tiny`` off CUDA, from
    :data:`GPU_DEFAULTS` otherwise; returns ``args``."""
    table = CPU_DEFAULTS if args.device != "cuda" and args.geometry == "tiny" else GPU_DEFAULTS
    for key, value in table.items():
        if getattr(args, key, None) is None:
            setattr(args, key, list(value) if isinstance(value, list) else value)
    return args


def add_report_args(p: argparse.ArgumentParser) -> None:
    gpu, cpu = GPU_DEFAULTS, CPU_DEFAULTS

    def sizes(key: str) -> str:
        return f"(default {gpu[key]}; {cpu[key]} for --geometry tiny on a CPU)"

    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help=f"packed tokens per step (ragged documents) {sizes('tokens')}")
    p.add_argument("--layers", nargs="+", default=["csa", "hca"], choices=["csa", "hca"])
    p.add_argument("--cp", type=int, nargs="+", default=None, help=f"context-parallel sizes {sizes('cp')}")
    p.add_argument("--partitions", nargs="+", default=["contiguous", "balanced"],
                   choices=["contiguous", "balanced"])
    p.add_argument("--paths", nargs="+", default=["triton", "reference", "unfused", "hf"],
                   choices=["triton", "reference", "unfused", "hf"],
                   help="fused kernels, PyTorch reference (block-recomputed core), the reference with every "
                        "per-head tensor kept (unfused), HF eager")
    p.add_argument("--reference-max-tokens", type=int, default=None,
                   help=f"longest stream for the reference and unfused paths {sizes('reference_max_tokens')}")
    p.add_argument("--reference-cp-max-tokens", type=int, default=None,
                   help="longest stream for the reference at CP > 1 (default: --reference-max-tokens)")
    p.add_argument("--hf-max-tokens", type=int, default=None,
                   help=f"longest stream for HF eager (CP=1 only) {sizes('hf_max_tokens')}")
    p.add_argument("--balance-tokens", type=int, nargs="*", default=None,
                   help="token counts for the isolated per-rank timing (default: the largest)")
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per case (after one warm-up) {sizes('steps')}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--geometry", default="real", choices=["real", "tiny"],
                   help="V4-Flash attention geometry, or a tiny one for CPU smoke runs")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (default when available) or cpu; on a CPU the real geometry needs --force")
    p.add_argument("--force", action="store_true",
                   help="run the GPU-sized cases (--geometry real) on a CPU anyway (hours or more)")
    # a fresh directory by default: the committed report (docs/report) is only written when asked for
    p.add_argument("--out", "--output", dest="out", default="csattn-report",
                   help="output folder (JSON, Markdown, PNG), created if missing (default %(default)s)")
    p.add_argument("--model-tokens", type=int, nargs="*", default=None,
                   help="tokens per step of the model rows: one training step of the 4-layer DeepSeek-V4 proxy "
                        f"(none: no model rows) {sizes('model_tokens')}")
    p.add_argument("--model-routing", nargs="+", default=None, metavar="ExK",
                   help=f"routed experts x experts per token of the model rows {sizes('model_routing')}")
    p.add_argument("--hf-model-max-tokens", type=int, default=None,
                   help="longest stream for HF eager's model rows (one document; 'hf' in --paths) "
                        f"{sizes('hf_model_max_tokens')}")
    p.add_argument("--group-timeout", type=int, default=1800, help="seconds before a hung group is killed")
    p.add_argument("--merge", nargs="+", default=None, metavar="REPORT_JSON",
                   help="measure nothing: combine these report.json files (a later file's cases replace an "
                        "earlier one's) and write the report into --out")


def plan_groups(args) -> list[tuple[int, str, list[Job]]]:
    """``(cp size, partition, jobs)`` per process group; jobs ascend in tokens within each (path, layer)."""
    groups = []
    for size in args.cp:
        partitions = ["contiguous"] if size == 1 else args.partitions
        for part in partitions:
            jobs = []
            for path in args.paths:
                if path == "hf" and size > 1:
                    continue
                if path == "triton" and args.device != "cuda":
                    continue
                ref_cap = args.reference_max_tokens
                if size > 1 and getattr(args, "reference_cp_max_tokens", None) is not None:
                    ref_cap = args.reference_cp_max_tokens
                cap = {"reference": ref_cap, "unfused": ref_cap, "hf": args.hf_max_tokens}.get(path, 1 << 62)
                for layer in args.layers:
                    jobs += [Job(layer, t, path, part) for t in sorted(args.tokens) if t <= cap]
            if jobs:
                groups.append((size, part, jobs))
    return groups


def plan_model_jobs(args) -> list[tuple[str, int, int, int]]:
    """``(path, tokens, experts, topk)`` of the model rows: csattn at every ``--model-tokens``, HF eager (one
    document) up to ``--hf-model-max-tokens`` when ``hf`` is among ``--paths``, for each ``--model-routing``."""
    jobs = []
    for routing in args.model_routing:
        experts, sep, topk = str(routing).partition("x")
        if not sep or not experts.isdigit() or not topk.isdigit():
            raise ValueError(f"--model-routing entries read ExK (e.g. 64x6), got {routing!r}")
        for t in sorted(args.model_tokens or []):
            jobs.append(("csattn", t, int(experts), int(topk)))
            if "hf" in args.paths and t <= args.hf_model_max_tokens:
                jobs.append(("hf", t, int(experts), int(topk)))
    return jobs


def run_model_jobs(jobs: list[tuple[str, int, int, int]], opts: dict, out_path: str) -> None:
    """Run the model rows one after another in this process, appending one JSON line per row to ``out_path``."""
    from .model import model_step_record

    for path, tokens, experts, topk in jobs:
        try:
            rec = model_step_record(path, tokens, experts, topk, opts)
        except ImportError as e:  # HF without DeepseekV4
            rec = {"kind": "model", "layer": f"model {experts}x{topk}", "tokens": tokens, "path": path, "cp": 1,
                   "partition": "-", "error": f"skipped: {e}"}
        rec["commit"] = _git_commit()
        with open(out_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _spawn_group(size: int, jobs: list[Job], opts: dict, out_path: str, timeout: int) -> None:
    port = free_port()
    procs = [process(run_group, r, size, port, jobs, opts, out_path) for r in range(size)]
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    for p in procs:
        p.join(max(1.0, deadline - time.time()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def _in_own_process(target, args: tuple, out_path: str, timeout: int) -> list[dict]:
    """Run ``target(*args, out_path)`` in a process of its own (killed after ``timeout`` s); its JSON-line records."""
    p = process(target, *args, out_path)
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
    return _read_lines(out_path)


def _read_lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _run_groups(groups, opts, tmp, timeout, bar, flush) -> list[dict]:
    """Run every group; ``flush(records)`` after each, so a run cut short keeps what it measured."""
    records = []
    for size, part, jobs in groups:
        remaining = list(jobs)
        attempt = 0
        while remaining:
            out = os.path.join(tmp, f"g{size}-{part}-{attempt}")
            bar.set_description(f"CP={size} {part}: {len(remaining)} cases")
            _spawn_group(size, remaining, opts, out, timeout)
            got = [rec for r in range(size) for rec in _read_lines(f"{out}.{r}")]
            records += got
            done = {(g["layer"], g["tokens"], g["path"]) for g in got if "error" not in g}
            bar.update(len({(g["layer"], g["tokens"], g["path"]) for g in got}))
            failed = next((j for j in remaining if (j.layer, j.tokens, j.path) not in done), None)
            if failed is None:
                break
            # the first case that did not finish ends its (path, layer) series: longer ones cannot fit
            if not any(g.get("error") for g in got if (g["layer"], g["tokens"], g["path"])
                       == (failed.layer, failed.tokens, failed.path)):
                records.append({"layer": failed.layer, "tokens": failed.tokens, "path": failed.path,
                                "partition": part, "cp": size, "rank": -1, "kind": "group",
                                "error": "failed (see logs)"})
            skipped = [j for j in remaining if j.layer == failed.layer and j.path == failed.path
                       and j.tokens >= failed.tokens]
            bar.update(len(skipped) - 1)
            remaining = [j for j in remaining if j not in skipped and (j.layer, j.tokens, j.path) not in done]
            attempt += 1
        flush(records)
    return records


def _git_commit() -> str:
    if os.environ.get("CSATTN_COMMIT"):  # the device machine's copy of the tree has no git history
        return os.environ["CSATTN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _case_key(r: dict) -> tuple:
    return (r.get("kind"), r["layer"], r["tokens"], r["path"], r["cp"], r.get("partition"), r.get("rank"))


def merge_reports(paths: list[str], out_dir: str) -> str:
    """Combine report JSON files (one report split over several device sessions) and render the result.

    A case (layer, tokens, path, CP, partition) present in a later file replaces all of its records from the
    earlier files. The metadata is the last file's, with every file's commit listed.
    """
    from .render import render_report

    records: dict[tuple, dict] = {}
    metas = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        metas.append(data["meta"])
        new = data["records"]
        for r in new:  # each row remembers the commit it was measured at (a merged file's rows already do)
            r.setdefault("commit", data["meta"]["commit"])
        cases = {_case_key(r)[:6] for r in new}
        records = {k: v for k, v in records.items() if k[:6] not in cases}
        records.update({_case_key(r): r for r in new})
    meta = dict(metas[-1])
    meta["commit"] = " + ".join(dict.fromkeys(m["commit"] for m in metas))
    if len({m["steps"] for m in metas}) > 1:  # an already merged file's steps text is kept as it is
        meta["steps"] = " / ".join(dict.fromkeys(m["steps"] if isinstance(m["steps"], str)
                                                 else f"{m['steps']} ({m['commit']})" for m in metas))
    merged = list(records.values())
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump({"meta": meta, "records": merged, "merged_from": metas}, f, indent=1)
    return render_report(meta, merged, out_dir)


def run_report(args: argparse.Namespace) -> int:
    from .render import render_report

    if getattr(args, "merge", None):
        print(merge_reports(args.merge, args.out))
        print(f"wrote the merged report (report.json, report.md, PNG plots) to {os.path.abspath(args.out)}")
        return 0

    resolve_defaults(args)
    opts = {"dtype": args.dtype, "geometry": args.geometry, "device": args.device, "steps": args.steps}
    groups = plan_groups(args)
    total = sum(len(j) for _, _, j in groups)
    balance_tokens = args.balance_tokens if args.balance_tokens is not None else [max(args.tokens)]
    balance_path = "triton" if args.device == "cuda" else "reference"
    balance_jobs = [Job(layer, t, balance_path, part) for layer in args.layers for t in balance_tokens
                    for part in args.partitions]
    sizes = [s for s in args.cp if s > 1]
    model_jobs = plan_model_jobs(args)
    total += len(model_jobs)
    if args.device != "cuda" and args.geometry == "real":
        # the defaults are sized for a GPU: on a CPU they would run for hours to days before writing a table
        what = (f"csattn report --device {args.device}: {total + len(balance_jobs) * sum(sizes)} cases of the "
                f"V4-Flash geometry (--geometry real) at up to {max(args.tokens)} tokens, sized for a GPU")
        if not getattr(args, "force", False):
            raise ValueError(f"{what}. Run it on a GPU (--device cuda), pass --geometry tiny for a CPU smoke "
                             "run, or add --force to run these cases on the CPU anyway")
        warnings.warn(f"{what}: running them on the CPU because of --force (expect hours or more)", stacklevel=2)
    print(f"writing the report to {os.path.abspath(args.out)}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = {"commit": _git_commit(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC",
            time.gmtime()), "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
            "dtype": args.dtype, "geometry": args.geometry, "steps": args.steps, "args": vars(args)}

    def flush(records: list[dict]) -> str:
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
        return render_report(meta, records, args.out)

    with tempfile.TemporaryDirectory() as tmp, tqdm(total=total + len(balance_jobs) * sum(sizes),
                                                    desc="report", unit="case") as bar:
        iso: list[dict] = []
        # the per-rank balance timing first: one process, short, and what the partition targets are judged on
        if sizes and balance_jobs:
            bar.set_description("isolated per-rank timing")
            iso = _in_own_process(run_isolated, (balance_jobs, sizes, opts), os.path.join(tmp, "isolated"),
                                  args.group_timeout)
            bar.update(len(iso))
            flush(iso)
        records = iso + _run_groups(groups, opts, tmp, args.group_timeout, bar, lambda recs: flush(iso + recs))
        if model_jobs:
            bar.set_description("model step")  # its own process: the layer cases' allocator state stays out
            model_recs = _in_own_process(run_model_jobs, (model_jobs, opts), os.path.join(tmp, "model"),
                                         args.group_timeout)
            bar.update(len(model_recs))
            records += model_recs
    print(flush(records))
    print(f"wrote report.json, report.md and PNG plots to {os.path.abspath(args.out)}")
    return 0
