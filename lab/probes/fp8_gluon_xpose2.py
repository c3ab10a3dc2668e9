"""The Gluon input gradient with the weight tile's transposition split over two warpgroups: the producer transposes
the tile's first 64 columns (as it transposes both today, ``LAG`` steps behind its copies), a fourth partition of
its own the other 64; the stage is ready once both arrived (``ready`` counts two). The math warpgroups are the
library's (``gluon._math``, ``SIMPLE``), so the output must equal ``grouped_mm_gluon(..., trans=True)``'s bit for bit.

Why: at the slice's 16k tokens the input gradients run at bf16's speed (gate_up ~6.2 ms, down ~3.25 on an H100),
bound by the producer's transposition (``README.md``: the producer storing zeros and loading nothing ran 682 / 646
TFLOP/s, the kernel 526 / 535). With ``SIMPLE`` (one product in flight a warpgroup) the math warpgroups build without
spills at 152 registers (Triton 3.6), which leaves room for a second transposing warpgroup: 16 warps, ``2 MATH +
PRODUCER + XPOSE <= 512`` registers a thread (a transposer of its own beside 224-register math warpgroups, measured
at 316d37a, spilled).

    PYTHONPATH=. python -m lab.probes.fp8_gluon_xpose2 --build     # any machine: spills, setmaxnreg, shared memory
    PYTHONPATH=. python -m lab.probes.fp8_gluon_xpose2             # sm_90: bits against the kernel, both timed
"""

from __future__ import annotations

import argparse
import re
import sys
from functools import partial

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from csattn.ops.fp8.gluon import _LOWER, _UPPER, _math, prepared, tile_descs, transpose_layout
from csattn.ops.fp8.gluon_low_rank import _low_rank_ring
from csattn.ops.fp8.gluon_tiles import BK, BM, BN, _cta_sync, _tile, _tma_load, tile_smem, tile_walk

SETTINGS = dict(GROUP_M=8, STAGES=4, LAG=2, MATH_REGS=168, PRODUCER_REGS=88, XPOSE_REGS=88)


@gluon.jit
def _transpose_piece(j, raw, bt, land, ready, C: gl.constexpr, STAGES: gl.constexpr):
    """Columns ``[64 C, 64 C + 64)`` of step ``j``'s weight tile into its K-major buffer, then one arrival on
    ``ready`` (every thread of the warpgroup's stores in first)."""
    s = j % STAGES
    mbarrier.wait(land.index(s), (j // STAGES) & 1)
    piece = raw.index(s).slice(C * 64, 64, dim=1).load(transpose_layout())
    bt.index(s).slice(C * 64, 64, dim=0).store(gl.permute(piece, (1, 0)))
    fence_async_shared()
    _cta_sync()
    mbarrier.arrive(ready.index(s), count=1)


@gluon.jit
def _producer(a_desc, w_desc, table, KC, E, W_ROWS, tiles_m, tiles_n, smem, E_P2: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, LAG: gl.constexpr):
    """``gluon._producer``'s TRANS path, transposing the first 64 columns of each tile only."""
    a_smem, raw, bt, land, ready, empty = smem
    nk = KC // BK
    it = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        g, row0, row_end, pid_n = _tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M)
        if g < E:
            for kb in range(nk):
                if it >= LAG:
                    _transpose_piece(it - LAG, raw, bt, land, ready, 0, STAGES)
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(land.index(s), BM * BK + BK * BN)
                _tma_load(a_desc, [row0, kb * BK], land.index(s), a_smem.index(s))
                _tma_load(w_desc, [g * W_ROWS + kb * BK, pid_n * BN], land.index(s), raw.index(s))
                it += 1
    for j in range(gl.maximum(it - LAG, 0), it):
        _transpose_piece(j, raw, bt, land, ready, 0, STAGES)


@gluon.jit
def _transposer(table, KC, E, tiles_m, tiles_n, smem, E_P2: gl.constexpr, GROUP_M: gl.constexpr,
                STAGES: gl.constexpr):
    """The other 64 columns of every step's weight tile, as each lands (the producer copied it only once the
    stage was free, so its buffer is)."""
    a_smem, raw, bt, land, ready, empty = smem
    nk = KC // BK
    it = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        g, row0, row_end, pid_n = _tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M)
        if g < E:
            for _kb in range(nk):
                _transpose_piece(it, raw, bt, land, ready, 1, STAGES)
                it += 1


@gluon.jit
def xpose2_kernel(a_desc, w_desc, sa, sw, table, out, KC, E, W_ROWS, tiles_m, tiles_n, stride_sam, stride_sak,
                  stride_swe, stride_sbk, stride_sbn, stride_om, E_P2: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr, LAG: gl.constexpr, MATH_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                  XPOSE_REGS: gl.constexpr):
    """``gluon.fp8_grouped_gluon_kernel`` with ``TRANS`` (no low-rank term), its transposition in two warpgroups."""
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], tile_smem())
    raw = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BK, BN], tile_smem())
    bt = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], tile_smem())
    land = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(land.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
        mbarrier.init(ready.index(s), count=2)  # both transposing warpgroups
    smem = (a_smem, raw, bt, land, ready, empty)
    low_rank = _low_rank_ring(a_desc, a_desc, 0.0, a_smem, land, empty, False)
    gl.warp_specialize([
        (_math, (sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe, stride_sbk,
                 stride_sbn, stride_om, smem, low_rank, _UPPER, True, E_P2, GROUP_M, STAGES, False, True, True)),
        (_math, (sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe, stride_sbk,
                 stride_sbn, stride_om, smem, low_rank, _LOWER, True, E_P2, GROUP_M, STAGES, False, True, True)),
        (_producer, (a_desc, w_desc, table, KC, E, W_ROWS, tiles_m, tiles_n, smem, E_P2, GROUP_M, STAGES, LAG)),
        (_transposer, (table, KC, E, tiles_m, tiles_n, smem, E_P2, GROUP_M, STAGES)),
    ], [4, 4, 4], [MATH_REGS, PRODUCER_REGS, XPOSE_REGS])


def input_grad_xpose2(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      offs: torch.Tensor, settings: dict | None = None) -> torch.Tensor:
    """``grouped_mm_gluon(a, a_scale, weight, scale, offs, trans=True)`` by :func:`xpose2_kernel`."""
    m, c = a.shape
    e, n_w, k_w = weight.shape
    a, a_scale, weight, scale, out = prepared(a, a_scale, weight, scale, None, k_w, torch.bfloat16)
    walk = tile_walk(offs, m, k_w, BM.value, BN.value)
    a_desc, w_desc = tile_descs(a, weight, BM.value, 128)
    xpose2_kernel[walk.grid](
        a_desc, w_desc, a_scale, scale, walk.table, out, c, e, n_w, walk.tiles_m, walk.tiles_n, a_scale.stride(0),
        a_scale.stride(1), scale.stride(0), scale.stride(1), scale.stride(2), out.stride(0), E_P2=walk.e_p2,
        **{**SETTINGS, **(settings or {})}, num_warps=4)
    return out


def build(math_regs: list[int]) -> None:
    """For sm_90 without a GPU: ptxas's spills and the register split at each math warpgroups' count."""
    from tests.ops.gluon_sm90 import build_sm90

    desc = f"tensordesc<fp8e4nv[128, 128],{tile_smem()!r}>"
    ints = ("KC", "E", "W_ROWS", "tiles_m", "tiles_n", "stride_sam", "stride_sak", "stride_swe", "stride_sbk",
            "stride_sbn", "stride_om")
    sig = {"a_desc": desc, "w_desc": desc, "sa": "*fp32", "sw": "*fp32", "table": "*i32", "out": "*bf16",
           **{k: "i32" for k in ints}}
    for regs in math_regs:
        rest = (512 - 2 * regs) // 2 // 8 * 8
        cfg = {**SETTINGS, "MATH_REGS": regs, "PRODUCER_REGS": rest, "XPOSE_REGS": rest}
        kernel, ptx, info = build_sm90(xpose2_kernel, sig, dict(E_P2=512, **cfg),
                                       [k for k, v in sig.items() if v.startswith("*")] + ["stride_om"])
        split = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
        print(f"math {regs}, producer / transposer {rest}: ptxas rc {info['ptxas_rc']}, spill stores "
              f"{info['spill_stores']}, setmaxnreg {split}, shared {kernel.metadata.shared}", flush=True)


def measure() -> None:
    """On sm_90: at the slice's 16k tokens, both GEMMs' input gradients against the library kernel, bit for bit and
    timed (CUDA graphs), then the frozen MoE with the op's input gradient swapped for this one."""
    from benchmarks.providers.fp8 import _quantized, _routed
    from csattn.ops.fp8 import quantize_1x128
    from csattn.ops.fp8.gluon import grouped_mm_gluon
    from lab.probes.gluon_forms import bench

    dev = torch.device("cuda")
    shape = dict(tokens=16384, routing="256x6", hidden=4096, inter=2048, seed=0)
    ids, _, plan, e, _, gen = _routed(shape, dev)
    m = ids.numel()
    for name, n_w, k_w in (("gate_up", 2 * shape["inter"], shape["hidden"]), ("down", shape["hidden"], shape["inter"])):
        q, s = _quantized((e, n_w, k_w), dev, gen)
        qa, sa = quantize_1x128(torch.randn(m, n_w, device=dev, generator=gen, dtype=torch.bfloat16))
        base = grouped_mm_gluon(qa, sa, q, s, plan.offs, True)
        for regs in (168, 184):
            rest = (512 - 2 * regs) // 2 // 8 * 8
            cfg = {"MATH_REGS": regs, "PRODUCER_REGS": rest, "XPOSE_REGS": rest}
            got = input_grad_xpose2(qa, sa, q, s, plan.offs, cfg)
            torch.cuda.synchronize()
            print(f"{name}: two transposers (math {regs}) equal to the kernel: {torch.equal(got, base)}", flush=True)
            flop = 2.0 * m * n_w * k_w
            bench(name, f"two transposers, math {regs}", partial(input_grad_xpose2, qa, sa, q, s, plan.offs, cfg),
                  flop)
        bench(name, "the kernel (one transposer)", partial(grouped_mm_gluon, qa, sa, q, s, plan.offs, True), flop)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", nargs="*", type=int, default=None, help="math registers to build at (no GPU)")
    args = ap.parse_args()
    if args.build is not None:
        build(args.build or [152, 168, 184])
    else:
        measure()


if __name__ == "__main__":
    sys.exit(main())
