"""One benchmark entry point for every op: ``python -m benchmarks.run --op sparse_attn --mode fwd,bwd``.

Prints a table (median ms, TFLOP/s from the provider's nominal FLOPs, peak extra GiB allocated during one
call) and writes JSON with the GPU, commit and library versions. Providers live in
``benchmarks/providers/`` (see ``benchmarks/registry.py``); each op's shape options have defaults that
``--shape key=v1,v2`` overrides, several values giving a sweep.

Examples:
    python -m benchmarks.run --op sparse_attn --mode fwd,bwd,fwdbwd --providers triton,reference \\
        --shape tokens=4096,8192,32768 --json out/sparse_attn.json
    python -m benchmarks.run --op sparse_attn --mode fwd --providers 'triton[bk_fwd=64,warps_fwd=8]'
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
from contextlib import nullcontext

import torch

from csattn.deterministic import deterministic_mode
from csattn.models.deepseek_v4.flops import PEAK_FLOPS

from .registry import PROVIDERS, SHAPE_DEFAULTS, Skip, load_providers

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("fwd", "bwd", "fwdbwd")


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _split_providers(text: str) -> list[tuple[str, str]]:
    """``"triton[a=1,b=2],reference"`` -> ``[("triton", "a=1,b=2"), ("reference", "")]``."""
    out, depth, cur = [], 0, ""
    for ch in text + ",":
        if ch == "," and depth == 0:
            if cur:
                name, _, rest = cur.partition("[")
                out.append((name.strip(), rest.rstrip("]")))
            cur = ""
            continue
        depth += (ch == "[") - (ch == "]")
        cur += ch
    return out


def _timer(device: torch.device, warmup_ms: int, rep_ms: int, single: bool = False):
    if device.type == "cuda" and single:
        def bench(fn, leaves):  # one warm-up call, one timed call: for cases of many seconds a call
            for _ in range(2):
                for t in leaves:
                    t.grad = None
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize(device)
            return start.elapsed_time(end)
    elif device.type == "cuda":
        import triton.testing

        def bench(fn, leaves):
            return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=leaves,
                                           return_mode="median")
    else:
        def bench(fn, leaves):
            fn()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
    return bench


def _mode_fn(case, mode: str):
    """A closure that runs ``mode`` once; the backward gets a fixed random gradient for the first output."""
    if mode == "fwd":
        return case.forward
    outs = case.forward()
    grad = torch.randn_like(outs[0])
    if mode == "bwd":
        return lambda: torch.autograd.backward(outs[0], grad, retain_graph=True)
    return lambda: torch.autograd.backward(case.forward()[0], grad)


def _peak_gib(fn, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**30


def _kernel_times(fn, device: torch.device, iters: int = 3, top: int = 6) -> dict[str, float] | None:
    """Per-kernel device time (ms per call) of ``fn`` from the PyTorch profiler, largest first."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize(device)
    times = {}
    for ev in prof.key_averages():
        total = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if total:
            times[ev.key[:90]] = total / iters / 1e3
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:top])


def run_meta(device: torch.device, commit: str | None) -> dict:
    """The ``meta`` of a benchmark JSON (the results page reads it): commit (``git rev-parse`` if None), versions,
    device, date, argv."""
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    meta = {"commit": commit, "torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "argv": sys.argv[1:]}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta


def main(argv: list[str] | None = None) -> list[dict]:
    load_providers()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", required=True, choices=sorted(PROVIDERS))
    ap.add_argument("--mode", default="fwd,bwd,fwdbwd", help="comma list of fwd, bwd, fwdbwd")
    ap.add_argument("--providers", default=None, help="comma list; name[variant] passes a variant string")
    ap.add_argument("--shape", action="append", default=[], help="key=v1,v2 (repeatable); sweeps the values")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--warmup-ms", type=int, default=25)
    ap.add_argument("--rep-ms", type=int, default=200)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--commit", default=None, help="recorded commit (default: git rev-parse)")
    ap.add_argument("--profile", action="store_true", help="also record per-kernel times (torch.profiler)")
    ap.add_argument("--single", action="store_true",
                    help="time one call after one warm-up call (CUDA events) instead of do_bench's median, for "
                         "cases that take seconds")
    ap.add_argument("--profile-top", type=int, default=6, help="with --profile: how many kernels to list")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_FLOPS / 1e12,
                    help=f"the GPU's dense bf16 matmul rate for MFU (default: {PEAK_FLOPS / 1e12:.0f}, measured on "
                         "the H200)")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch's deterministic mode for the whole run (csattn.deterministic_mode, before any "
                         "CUDA work), as csattn train --deterministic sets it; the kernels' own flag is the "
                         "providers' deterministic=1 variant")
    args = ap.parse_args(argv)
    modes = [m for m in args.mode.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"--mode: {m!r} is not one of {MODES}")
    providers = _split_providers(args.providers or ",".join(PROVIDERS[args.op]))
    for name, _ in providers:
        if name not in PROVIDERS[args.op]:
            ap.error(f"--providers: {name!r} is not registered for {args.op} ({sorted(PROVIDERS[args.op])})")
    sweep = {k: [v] for k, v in SHAPE_DEFAULTS.get(args.op, {}).items()}
    for item in args.shape:
        key, _, values = item.partition("=")
        if key not in sweep:
            ap.error(f"--shape: unknown key {key!r} for {args.op} (known: {sorted(sweep)})")
        sweep[key] = [_parse_value(v) for v in values.split(",")]
    with deterministic_mode() if args.deterministic else nullcontext():
        return _sweep(args, modes, providers, sweep)


def _sweep(args: argparse.Namespace, modes: list[str], providers: list[tuple[str, str]],
           sweep: dict[str, list]) -> list[dict]:
    """Every shape of ``sweep`` x provider x mode, printed and written to ``args.json`` as it goes."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    bench = _timer(device, args.warmup_ms, args.rep_ms, args.single)
    meta = run_meta(device, args.commit)
    results: list[dict] = []
    print(f"# {meta['device']}  commit {meta['commit']}  torch {meta['torch']}  triton {meta.get('triton')}")
    header = f"{'provider':<28} {'mode':<7} {'shape':<40} {'ms':>10} {'TFLOP/s':>9} {'GiB':>8}"
    print(header)
    for values in itertools.product(*sweep.values()):
        shape = dict(zip(sweep, values))
        label = ",".join(f"{k}={v}" for k, v in shape.items() if len(sweep[k]) > 1 or k == "tokens")
        for name, variant in providers:
            tag = f"{name}[{variant}]" if variant else name
            base = {"op": args.op, "provider": name, "variant": variant, "shape": shape, "dtype": args.dtype}
            try:
                case = PROVIDERS[args.op][name](shape, device, dtype, variant)
            except Skip as e:
                results.append({**base, "skipped": str(e)})
                print(f"{tag:<28} {'-':<7} {label:<40} skipped: {e}")
                continue
            for mode in modes:
                rec = {**base, "mode": mode, "info": case.info}
                try:
                    fn = _mode_fn(case, mode)
                    ms = bench(fn, case.leaves)
                    flops = case.flops.get(mode, case.flops.get("fwd", 0) + case.flops.get("bwd", 0))
                    rec.update(ms=ms, tflops=flops / ms / 1e9 if flops else None, peak_gib=_peak_gib(fn, device))
                    if device.type == "cuda":  # weights, gradients and activations together
                        rec["peak_total_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                    if "tokens" in case.info:  # whole-model cases: throughput and utilization of the peak
                        rec["tokens_per_s"] = case.info["tokens"] / ms * 1e3
                        if rec["tflops"] and args.peak_tflops:
                            rec["mfu"] = rec["tflops"] / args.peak_tflops
                    moved = case.info.get("bytes")
                    if isinstance(moved, dict) and moved:  # memory-bound cases: bytes one call must move
                        rec["gb_per_s"] = moved.get(mode, moved.get("fwd", 0) + moved.get("bwd", 0)) / ms / 1e6
                    tf = f"{rec['tflops']:9.1f}" if rec["tflops"] else f"{'-':>9}"
                    gib = f"{rec['peak_gib']:8.2f}" if rec["peak_gib"] is not None else f"{'-':>8}"
                    extra = f"  {rec['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in rec else ""
                    extra += f"  MFU {rec['mfu']:.1%}" if "mfu" in rec else ""
                    extra += f"  {rec['gb_per_s']:.0f} GB/s" if "gb_per_s" in rec else ""
                    print(f"{tag:<28} {mode:<7} {label:<40} {ms:10.3f} {tf} {gib}{extra}", flush=True)
                    if args.profile:
                        rec["kernels_ms"] = _kernel_times(fn, device, top=args.profile_top)
                        for kname, kms in (rec["kernels_ms"] or {}).items():
                            print(f"    {kms:9.3f} ms  {kname}")
                except torch.cuda.OutOfMemoryError:
                    rec["error"] = "out of memory"
                    print(f"{tag:<28} {mode:<7} {label:<40} out of memory", flush=True)
                except Exception as e:  # keep the sweep going; the JSON records what broke
                    rec["error"] = f"{type(e).__name__}: {e}"
                    print(f"{tag:<28} {mode:<7} {label:<40} error: {rec['error'][:200]}", flush=True)
                    traceback.print_exc(limit=3)
                results.append(rec)
                _dump(args.json, meta, results)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del case
    _dump(args.json, meta, results)
    return results


def _dump(path: str | None, meta: dict, results: list[dict]) -> None:
    """Rewrite the JSON after every record, so a run cut short still leaves its numbers."""
    if path:
        with open(path, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
