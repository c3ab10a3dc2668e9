"""Where the frozen-expert MoE's wall time goes beyond its kernels (256 experts top-6, 16k tokens; forward + input
gradient as ``benchmarks.run --op moe_frozen`` times it): for the FP8 and the bf16 paths,

- ``do_bench``: the benchmark's median (L2 flushed before each call, the call timed alone);
- ``gpu``: the same call enqueued behind a ~30 ms sleep kernel, so the host has run ahead before the first of its
  kernels starts: the kernels' time with no wait for the host;
- ``host``: the host's time to enqueue the call (measured while the GPU sleeps);
- the Python functions that take the FP8 path's host time (cProfile, 10 calls, by own time).

    PYTHONPATH=. python -m lab.probes.moe_host
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch
import triton.testing

from lab.probes.gluon_forms import moe_step

SLEEP_CYCLES = 60_000_000  # ~30 ms at ~1.98 GHz


def behind_sleep(step, reps: int = 10) -> tuple[float, float]:
    """Median kernel time of ``step`` enqueued behind a sleep, and median host time to enqueue it."""
    gpu, host = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return sorted(gpu)[reps // 2], sorted(host)[reps // 2]


def main() -> None:
    print(f"== {torch.cuda.get_device_name()}", flush=True)
    for compute in ("fp8", "bf16", "fp8", "bf16"):
        step = moe_step(compute)
        for _ in range(3):
            step()
        bench = triton.testing.do_bench(step, warmup=100, rep=500, return_mode="median")
        gpu, host = behind_sleep(step)
        print(f"{compute:5s} do_bench {bench:7.3f} ms   gpu (host ahead) {gpu:7.3f} ms   host enqueue {host:7.3f} ms",
              flush=True)
    step = moe_step("fp8")
    step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    torch.cuda._sleep(SLEEP_CYCLES * 10)
    prof.enable()
    for _ in range(10):
        step()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue())


if __name__ == "__main__":
    main()
