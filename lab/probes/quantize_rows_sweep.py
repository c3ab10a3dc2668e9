"""The MoE's token rows quantized into expert order (``quantize_rows_triton``: x and dout of the frozen-expert MoE,
16k tokens of 4096, 256 experts top-6) over a program's rows and warps, against quantizing at token level and
gathering the codes and scales after (``index_select``, the form before 3637acf), each timed in a CUDA graph, the
bits compared with it.

    PYTHONPATH=. python -m lab.probes.quantize_rows_sweep
"""

from __future__ import annotations

import itertools

import torch
import triton

from csattn.ops.fp8 import Fp8Rows, quantize_1x128
from csattn.ops.fp8.triton import quantize_rows_triton
from csattn.ops.moe import route_plan

T, D, E, K = 16384, 4096, 256, 6


def timed(way: str, call, nbytes: float) -> None:
    ms = triton.testing.do_bench_cudagraph(call, rep=100)
    print(f"{way:44s} {ms:7.4f} ms {nbytes / ms / 1e9:7.3f} TB/s", flush=True)


def main() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, D, device=dev, generator=g, dtype=torch.bfloat16)
    experts = torch.topk(torch.randn(T, E, device=dev, generator=g), K, dim=-1).indices
    plan = route_plan(experts, E)
    dest = plan.inv.view(T, K)
    nbytes = T * D * 2 + T * K * (D + D // 128 * 4)  # x read once, the rows written
    print(f"== {torch.cuda.get_device_name()}", flush=True)
    want = Fp8Rows(*quantize_1x128(x)).index_select(plan.token)
    timed("quantize, then index_select (codes, scales)",
          lambda: Fp8Rows(*quantize_1x128(x)).index_select(plan.token), nbytes)
    for rows, warps in itertools.product((1, 2, 4, 8, 16, 32), (1, 2, 4, 8)):
        out = Fp8Rows.empty(T * K, D, dev)
        quantize_rows_triton(x, dest, out=out, rows=rows, warps=warps)
        torch.cuda.synchronize()
        same = torch.equal(out.q.view(torch.uint8), want.q.view(torch.uint8)) and torch.equal(out.s, want.s)
        timed(f"into rows: rows {rows:2d} warps {warps} bits {same}",
              lambda out=out, rows=rows, warps=warps: quantize_rows_triton(x, dest, out=out, rows=rows, warps=warps),
              nbytes)


if __name__ == "__main__":
    main()
