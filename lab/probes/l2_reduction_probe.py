"""How fast L2 takes the Gluon backward's dkv reductions alone: ``red_rows`` (the backward's own reduction code,
whole-line ``red.v4`` from the MMA layout) over the sparse-attention benchmark's index lists, 640 keys a row, every
64-column chunk of d = 512, with nothing else running. The rate it reaches bounds the backward's time from below
(``T x 640 x 2 KB`` of reductions) unless the bytes fall. Beside it, the same reductions as TMA-unit bulk
reductions from shared memory (``cp.reduce.async.bulk ... .add.f32``, 128 or 256 bytes of a key row each), the
other way Hopper has to add into global memory: on the H200 both reach about 3.8 TB/s (lab/LOG.md), so the
rate is L2's, not the instruction's.

    PYTHONPATH=. python lab/probes/l2_reduction_probe.py --json out/l2_reduction_probe.json      # an sm_90 GPU
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from benchmarks.providers.sparse_attn import packed_indices
from csattn.ops.sparse_attn.gluon_bwd import red_rows
from csattn.ops.sparse_attn.gluon_fwd import mma_layout


@gluon.jit
def _reductions(dkv, idx, n_rows, row_stride, K: gl.constexpr, BD: gl.constexpr):
    """Each program (one warpgroup) takes work items ``pid, pid + n_programs, ...`` as the persistent backward does
    and adds a constant ``[64, 64]`` tile into every chunk of every 64-key tile's rows. Item ``w`` is row
    ``w * row_stride mod n_rows`` (``row_stride`` prime to ``n_rows``): with 1, the programs at work at one time
    hold neighbouring rows, whose window keys are mostly the same rows of ``dkv``."""
    C_L: gl.constexpr = mma_layout(64, 1)
    pid = gl.program_id(0)
    tile = gl.full([64, 64], 1.0, gl.float32, C_L)
    for w in range(pid, n_rows, gl.num_programs(0)):
        row = (w.to(gl.int64) * row_stride) % n_rows
        for i in range(K // 64):
            ids = gl.load(idx + row * K + i * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, C_L)))
            for c in gl.static_range(BD // 64):
                red_rows(dkv, ids, tile, c * 64, BD)


@gluon.jit
def _bulk_reductions(dkv, idx, n_rows, K: gl.constexpr, BD: gl.constexpr, NB: gl.constexpr, STORE: gl.constexpr):
    """The same sums as ``_reductions`` as bulk reductions of ``NB`` bytes, one a thread, from two ``[64, 64]``
    fp32 staging tiles used by turns (a tile is reused once the bulk group that read it is done reading).
    ``STORE``: write the staging tile before each chunk (as a kernel would), else write it once. The asm finds
    the tiles at the start of ``global_smem``: they are this kernel's only shared memory."""
    C_L: gl.constexpr = mma_layout(64, 1)
    stage = gl.allocate_shared_memory(gl.float32, [2, 64, 64], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    tile = gl.full([64, 64], 1.0, gl.float32, C_L)
    stage.index(0).store(tile)
    stage.index(1).store(tile)
    PER_ROW: gl.constexpr = 256 // NB  # threads a key row's 256-byte chunk
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    e = gl.arange(0, 128, layout=L)
    r = gl.minimum(e // PER_ROW, 63)
    part = e % PER_ROW
    active = (e < 64 * PER_ROW).to(gl.int32)
    fence_async_shared()
    for w in range(gl.program_id(0), n_rows, gl.num_programs(0)):
        for i in range(K // 64):
            ids = gl.load(idx + w * K + i * 64 + r)
            on = active * (ids >= 0).to(gl.int32)
            for c in gl.static_range(BD // 64):
                if STORE:
                    stage.index(c % 2).store(tile)
                    fence_async_shared()
                src = (c % 2) * 64 * 64 * 4 + r * 256 + part * NB
                dst = (dkv + ids.to(gl.int64) * BD + c * 64 + part * (NB // 4)).to(gl.int64)
                gl.inline_asm_elementwise(
                    "{ .reg .pred p; .reg .u32 s; setp.ne.b32 p, $3, 0; mov.u32 s, global_smem; add.u32 s, s, $2; "
                    f"@p cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$1], [s], {NB}; "
                    "cp.async.bulk.commit_group; cp.async.bulk.wait_group.read 1; mov.b32 $0, 0; }",
                    "=r,l,r,r", [dst, src, on], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.b32 $0, 0;", "=r,r", [e], dtype=gl.int32,
                              is_pure=False, pack=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--json", default=None)
    ap.add_argument("--row-strides", default="1,257",
                    help="whole-line red.v4 again with item w on row w * stride mod T (strides prime to T)")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    strides = [int(s) for s in args.row_strides.split(",")]
    for T in tokens:
        if any(math.gcd(s, T) != 1 for s in strides):
            ap.error(f"--row-strides {args.row_strides}: each stride must be prime to every token count ({T})")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for T in tokens:
        gen = torch.Generator(device="cuda").manual_seed(0)
        idx, N = packed_indices(T, 0, 128, 512, 4, "cuda", gen)
        dkv = torch.zeros(N, 512, device="cuda", dtype=torch.float32)
        nbytes = float((idx >= 0).sum()) * 512 * 4
        # the half-line layout left the kernels with its switch (lab/NOTES.md; its rate: results/..._f1bb521.json)
        variants = {"red_v4_full_lines": (_reductions, dict(row_stride=1)),
                    "bulk_256B": (_bulk_reductions, dict(NB=256, STORE=False)),
                    "bulk_128B": (_bulk_reductions, dict(NB=128, STORE=False)),
                    "bulk_256B_staged": (_bulk_reductions, dict(NB=256, STORE=True))}
        variants.update({f"red_v4_full_lines_row_stride_{s}": (_reductions, dict(row_stride=s))
                         for s in strides if s != 1})
        ref = None
        for per_sm in (1, 2):
            for name, (kernel, consts) in variants.items():
                dkv.zero_()
                launch = functools.partial(kernel[(sms * per_sm,)], dkv, idx, T, K=640, BD=512, num_warps=4,
                                           **consts)
                launch()
                # every variant adds 1 a reference into every column: the same per-key counts
                counts = dkv.sum(1)
                ref = counts if ref is None else ref
                ms = triton.testing.do_bench(launch, warmup=20, rep=100)
                r = dict(tokens=T, programs_per_sm=per_sm, variant=name, ms=ms, GB=nbytes / 1e9,
                         TBps=nbytes / ms / 1e9, same_sums=bool(torch.equal(counts, ref)),
                         gpu=torch.cuda.get_device_name())
                print(r, flush=True)
                results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
