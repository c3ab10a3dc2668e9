"""Where the frozen-expert MoE's time goes (256 experts top-6, 16k tokens, D 4096, I 2048; forward + input
gradient), FP8 experts against bf16: the CUDA kernels by total time under torch.profiler, five steps each.
Run on an H200: python -m lab.probes.moe_profile"""

import torch
from torch.profiler import ProfilerActivity, profile

from lab.probes.gluon_forms import moe_step


def main() -> None:
    for compute in ("fp8", "bf16"):
        step = moe_step(compute)  # its gradients returned, not accumulated (no add pass in the profile)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        total = sum(e.device_time_total for e in prof.key_averages()) / 5 / 1e3
        print(f"== {compute}: {total:.2f} ms of kernels a step")
        rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:14]
        for e in rows:
            print(f"  {e.device_time_total / 5 / 1e3:7.3f} ms  x{e.count // 5:<3d} {e.key[:110]}")


if __name__ == "__main__":
    main()
