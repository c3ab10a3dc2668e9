"""How fast L2 takes the Gluon backward's dkv reductions alone: ``red_rows`` (the backward's own reduction code,
whole-line ``red.v4`` from the MMA layout) over the sparse-attention benchmark's index lists, 640 keys a row, every
64-column chunk of d = 512, with nothing else running. The rate it reaches bounds the backward's time from below
(``T x 640 x 2 KB`` of reductions) unless the bytes fall.

    python -m benchmarks.l2_reduction_probe --json out/l2_reduction_probe.json      # an sm_90 GPU
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from benchmarks.providers.sparse_attn import packed_indices
from csattn.ops.sparse_attn.gluon_bwd import red_rows
from csattn.ops.sparse_attn.gluon_fwd import mma_layout


@gluon.jit
def _reductions(dkv, idx, n_rows, K: gl.constexpr, BD: gl.constexpr, FULL_LINES: gl.constexpr):
    """Each program (one warpgroup) takes rows ``pid, pid + n_programs, ...`` as the persistent backward does and
    adds a constant ``[64, 64]`` tile into every chunk of every 64-key tile's rows."""
    C_L: gl.constexpr = mma_layout(64, 1)
    pid = gl.program_id(0)
    tile = gl.full([64, 64], 1.0, gl.float32, C_L)
    for w in range(pid, n_rows, gl.num_programs(0)):
        for i in range(K // 64):
            ids = gl.load(idx + w * K + i * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, C_L)))
            for c in gl.static_range(BD // 64):
                red_rows(dkv, ids, tile, c * 64, BD, FULL_LINES)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for T in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(0)
        idx, N = packed_indices(T, 0, 128, 512, 4, "cuda", gen)
        dkv = torch.zeros(N, 512, device="cuda", dtype=torch.float32)
        nbytes = float((idx >= 0).sum()) * 512 * 4
        for per_sm in (1, 2):
            for full_lines in (True, False):
                launch = functools.partial(_reductions[(sms * per_sm,)], dkv, idx, T, K=640, BD=512,
                                           FULL_LINES=full_lines, num_warps=4)
                ms = triton.testing.do_bench(launch, warmup=20, rep=100)
                r = dict(tokens=T, programs_per_sm=per_sm, full_lines=full_lines, ms=ms, GB=nbytes / 1e9,
                         TBps=nbytes / ms / 1e9, gpu=torch.cuda.get_device_name())
                print(r, flush=True)
                results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
