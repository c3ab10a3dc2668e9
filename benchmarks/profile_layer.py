"""Where the time of one step goes: ``torch.profiler`` over forward + backward of one ``--op layer`` case (or,
with ``--op model``, one training step of the model proxy).

Prints the CUDA kernels (and the CPU ops that launch them) sorted by total GPU time, the GPU-busy fraction of
the step (a low fraction means the host, not the GPU, sets the pace), and peak memory.

Example (on the GPU machine):
    python -m benchmarks.profile_layer --tokens 8192 --layer csa --provider triton --rows 40
    python -m benchmarks.profile_layer --op model --provider csattn --tokens 16384 --by shape   # who launches what
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from .registry import PROVIDERS, SHAPE_DEFAULTS, load_providers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", default="layer", choices=["layer", "model"])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layer", default="csa", choices=["sliding", "csa", "hca"])
    parser.add_argument("--provider", default="triton")
    parser.add_argument("--rows", type=int, default=40, help="rows of the kernel table")
    parser.add_argument("--trace", default=None, help="write a Chrome trace here")
    parser.add_argument("--by", default="kernel", choices=["kernel", "shape", "stack"],
                        help="also group the operators by their input shapes or by the Python lines that call them")
    args = parser.parse_args()

    load_providers()
    device = torch.device("cuda")
    shape = {**SHAPE_DEFAULTS[args.op], "tokens": args.tokens}
    if args.op == "layer":
        shape["layer"] = args.layer
    case = PROVIDERS[args.op][args.provider](shape, device, torch.bfloat16, "")
    dy = None

    def step():
        nonlocal dy
        for leaf in case.leaves:
            leaf.grad = None
        out = case.forward()[0]
        if dy is None and out.numel() > 1:
            dy = torch.randn_like(out)
        out.backward(dy)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=args.by == "shape",
                 with_stack=args.by == "stack") as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    # kernel rows only (operator rows repeat their kernels' time)
    gpu_total = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    print(f"{args.op} {args.layer if args.op == 'layer' else ''} tokens={args.tokens} provider={args.provider}: "
          f"step {wall:.1f} ms wall, "
          f"{gpu_total:.1f} ms of GPU kernels ({100 * gpu_total / wall:.0f} % busy), peak +{peak:.2f} GiB")
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70))
    if args.by != "kernel":
        grouped = prof.key_averages(group_by_input_shape=args.by == "shape", group_by_stack_n=5 * (args.by == "stack"))
        print(grouped.table(sort_by="device_time_total", row_limit=args.rows, max_name_column_width=60,
                            max_shapes_column_width=90))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
