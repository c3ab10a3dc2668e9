"""The Gluon input gradient two ways, by rows per expert: transposing each weight tile in the kernel (the producer, in
shared memory) against multiplying a K-major copy of the weights made for the call (``grouped.transposed_weight``,
one Triton pass) with the forward's kernel. Measures what ``grouped.COPY_ROWS_PER_EXPERT`` stands on.

Cases: the 256-expert slice at 16k tokens (~384 rows an expert: the in-kernel transposition's ground) and 64k (~1536),
and one rank of ep 8 (32 experts) at 8k and 16k tokens a rank (~1536 and ~3072: the one-node plan's ground). For each
GEMM: both routes (their outputs equal bit for bit), the copy alone (GB/s, read + write), bf16 ``grouped_mm``; then the
frozen-expert MoE forward + input gradient with the op's choice, each route forced, and bf16 experts.
Run on a GPU of sm_90: python -m lab.probes.fp8_dgrad_copy [slice:16k slice:64k ep8:8k ep8:16k]
"""

from __future__ import annotations

import sys
from functools import partial
from unittest import mock

import torch
import triton

import csattn.ops.fp8.grouped as fp8_grouped
from benchmarks.providers.fp8 import GROUPED, _quantized, _routed
from csattn.ops.fp8 import dequantize, quantize_1x128
from csattn.ops.fp8.gluon import grouped_mm_gluon
from csattn.ops.fp8.grouped import input_grad_copies, transposed_weight
from lab.probes.gluon_forms import bench, frozen_moe_ms

# (name, routing, tokens)
CASES = [("slice 16k", "256x6", 16384), ("slice 64k", "256x6", 65536), ("ep8 rank 8k", "32x6", 8192),
         ("ep8 rank 16k", "32x6", 16384)]


def copy_then_forward(qa, sa, q, s, offs) -> torch.Tensor:
    """The copy route as the op runs it: the weights' K-major copy, then the forward's kernel on it."""
    return grouped_mm_gluon(qa, sa, *transposed_weight(q, s), offs, False)


def gemms(shape: dict, dev: torch.device) -> None:
    """Both GEMMs' input gradients at ``shape``: each route, the copy alone, bf16 ``grouped_mm``."""
    ids, _, plan, e, _, gen = _routed(shape, dev)
    m = ids.numel()
    for name, n_w, k_w in (("gate_up", 2 * shape["inter"], shape["hidden"]), ("down", shape["hidden"], shape["inter"])):
        q, s = _quantized((e, n_w, k_w), dev, gen)
        dy = torch.randn(m, n_w, device=dev, generator=gen, dtype=torch.bfloat16)
        qa, sa = quantize_1x128(dy)
        wt, st = transposed_weight(q, s)
        same = torch.equal(grouped_mm_gluon(qa, sa, wt, st, plan.offs, False),
                           grouped_mm_gluon(qa, sa, q, s, plan.offs, True))
        print(f"  {name}: {m / e:.0f} rows an expert, the op copies: {input_grad_copies(m, e)}, routes equal: {same}",
              flush=True)
        flop = 2.0 * m * n_w * k_w
        bench(name, "in-kernel transposition", partial(grouped_mm_gluon, qa, sa, q, s, plan.offs, True), flop)
        bench(name, "copy + forward kernel", partial(copy_then_forward, qa, sa, q, s, plan.offs), flop)
        bench(name, "forward kernel on a resident copy", partial(grouped_mm_gluon, qa, sa, wt, st, plan.offs, False),
              flop)
        ms = triton.testing.do_bench_cudagraph(partial(transposed_weight, q, s), rep=60)
        print(f"{name:16s} {'the copy alone':44s} {ms:7.3f} ms {2 * q.numel() / ms / 1e6:7.1f} GB/s", flush=True)
        wb = torch.stack([dequantize(q[i], s[i], torch.bfloat16) for i in range(e)])
        bench(name, "bf16 grouped_mm", partial(torch.nn.functional.grouped_mm, dy, wb, offs=plan.offs), flop)
        del wb, wt, st
        torch.cuda.empty_cache()


def main(only: list[str]) -> None:
    """The cases named in ``only`` (their labels' first words and tokens, e.g. ``slice:16k``), or all."""
    dev = torch.device("cuda")
    for label, routing, tokens in CASES:
        if only and label.replace(" rank", "").replace(" ", ":") not in only:
            continue
        shape = {**GROUPED, "routing": routing, "tokens": tokens}
        print(f"== {label}: {routing}, {tokens} tokens", flush=True)
        gemms(shape, dev)
        bf16 = frozen_moe_ms("bf16", shape=shape)
        ways = {"the op's choice": None, "in-kernel transposition": 1 << 40, "copy": 0}
        for way, rows in ways.items():
            with mock.patch.object(fp8_grouped, "COPY_ROWS_PER_EXPERT",
                                   fp8_grouped.COPY_ROWS_PER_EXPERT if rows is None else rows):
                ms = frozen_moe_ms("fp8", shape=shape)
            print(f"frozen MoE fwd + input grad, {label}: FP8 {way} {ms:.2f} ms ({bf16 / ms:.2f}x bf16 {bf16:.2f})",
                  flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
