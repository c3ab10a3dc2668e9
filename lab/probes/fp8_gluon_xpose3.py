"""The Gluon input gradient with its copies and its transposition in partitions of their own: a one-warp copier that
only issues the TMA copies (no ``LAG``: it waits for a free stage and copies), and two transposing warpgroups, each
64 columns of every landed weight tile (``gluon._transposer``, pieces 0 and 1); the math warpgroups are the library's
(``SIMPLE``). The library's default (``SPLIT``) has the producer transpose the first piece between its copies, so
its copies wait behind a transposition; here they do not. Bit for bit the library's output, and both timed at the
slice's 16k tokens (CUDA graphs), then the frozen MoE with this kernel's input gradient swapped in.

Registers (20 warps: the copier's warp takes a warpgroup's place): math 176 (the first math warpgroup is given 152),
copier 24, transposers 64 each (Triton 3.6 needs 64 for a transposer's piece, ``gluon.launch_settings``); at 184 the
math warpgroups spilled 20-24 bytes (Triton 3.6 / 3.9). Built here without spills on both; not yet run on a GPU.

    PYTHONPATH=. python -m lab.probes.fp8_gluon_xpose3 --build    # any machine: spills and the register split
    PYTHONPATH=. python -m lab.probes.fp8_gluon_xpose3            # sm_90
"""

from __future__ import annotations

import argparse
import re
from functools import partial
from unittest import mock

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

import csattn.ops.fp8.gluon as fp8_gluon
from csattn.ops.fp8.gluon import _LOWER, _UPPER, _math, _transposer, prepared, tile_descs
from csattn.ops.fp8.gluon_low_rank import _low_rank_ring
from csattn.ops.fp8.gluon_tiles import BK, BM, BN, _tile, _tma_load, tile_smem, tile_walk

SETTINGS = dict(GROUP_M=8, STAGES=4, MATH_REGS=176, COPY_REGS=24, XPOSE_REGS=64)


@gluon.jit
def _copier(a_desc, w_desc, table, KC, E, W_ROWS, tiles_m, tiles_n, smem, E_P2: gl.constexpr,
            GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """Every TMA copy of the input gradient's ring, as soon as its stage is free."""
    a_smem, raw, bt, land, ready, empty = smem
    nk = KC // BK
    it = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        g, row0, row_end, pid_n = _tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M, WARPS=1)
        if g < E:
            for kb in range(nk):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(land.index(s), BM * BK + BK * BN)
                _tma_load(a_desc, [row0, kb * BK], land.index(s), a_smem.index(s))
                _tma_load(w_desc, [g * W_ROWS + kb * BK, pid_n * BN], land.index(s), raw.index(s))
                it += 1


@gluon.jit
def xpose3_kernel(a_desc, w_desc, sa, sw, table, out, KC, E, W_ROWS, tiles_m, tiles_n, stride_sam, stride_sak,
                  stride_swe, stride_sbk, stride_sbn, stride_om, E_P2: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr, MATH_REGS: gl.constexpr, COPY_REGS: gl.constexpr,
                  XPOSE_REGS: gl.constexpr):
    """``gluon.fp8_grouped_gluon_kernel`` with ``TRANS`` (no low-rank term): a copier warp, two transposers."""
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], tile_smem())
    raw = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BK, BN], tile_smem())
    bt = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], tile_smem())
    land = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(land.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
        mbarrier.init(ready.index(s), count=2)
    smem = (a_smem, raw, bt, land, ready, empty)
    low_rank = _low_rank_ring(a_desc, a_desc, 0.0, a_smem, land, empty, False)
    gl.warp_specialize([
        (_math, (sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe, stride_sbk,
                 stride_sbn, stride_om, smem, low_rank, _UPPER, True, E_P2, GROUP_M, STAGES, False, True, True)),
        (_math, (sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe, stride_sbk,
                 stride_sbn, stride_om, smem, low_rank, _LOWER, True, E_P2, GROUP_M, STAGES, False, True, True)),
        (_copier, (a_desc, w_desc, table, KC, E, W_ROWS, tiles_m, tiles_n, smem, E_P2, GROUP_M, STAGES)),
        (_transposer, (table, KC, E, tiles_m, tiles_n, smem, E_P2, GROUP_M, STAGES, 0)),
        (_transposer, (table, KC, E, tiles_m, tiles_n, smem, E_P2, GROUP_M, STAGES, 1)),
    ], [4, 1, 4, 4], [MATH_REGS, COPY_REGS, XPOSE_REGS, XPOSE_REGS])


def input_grad_xpose3(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      offs: torch.Tensor, settings: dict | None = None) -> torch.Tensor:
    """``grouped_mm_gluon(a, a_scale, weight, scale, offs, trans=True)`` by :func:`xpose3_kernel`."""
    m, c = a.shape
    e, n_w, k_w = weight.shape
    a, a_scale, weight, scale, out = prepared(a, a_scale, weight, scale, None, k_w, torch.bfloat16)
    walk = tile_walk(offs, m, k_w, BM.value, BN.value)
    a_desc, w_desc = tile_descs(a, weight, BM.value, 128)
    xpose3_kernel[walk.grid](
        a_desc, w_desc, a_scale, scale, walk.table, out, c, e, n_w, walk.tiles_m, walk.tiles_n, a_scale.stride(0),
        a_scale.stride(1), scale.stride(0), scale.stride(1), scale.stride(2), out.stride(0), E_P2=walk.e_p2,
        **{**SETTINGS, **(settings or {})}, num_warps=4)
    return out


def build() -> None:
    """For sm_90 without a GPU: ptxas's spills, the register split, shared memory."""
    from tests.ops.gluon_sm90 import build_sm90

    desc = f"tensordesc<fp8e4nv[128, 128],{tile_smem()!r}>"
    ints = ("KC", "E", "W_ROWS", "tiles_m", "tiles_n", "stride_sam", "stride_sak", "stride_swe", "stride_sbk",
            "stride_sbn", "stride_om")
    sig = {"a_desc": desc, "w_desc": desc, "sa": "*fp32", "sw": "*fp32", "table": "*i32", "out": "*bf16",
           **{k: "i32" for k in ints}}
    kernel, ptx, info = build_sm90(xpose3_kernel, sig, dict(E_P2=512, **SETTINGS),
                                   [k for k, v in sig.items() if v.startswith("*")] + ["stride_om"])
    split = [int(x) for x in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)]
    threads = re.findall(r"reqntid (\d+)", ptx)
    print(f"ptxas rc {info['ptxas_rc']}, spill stores {info['spill_stores']}, setmaxnreg {split}, threads "
          f"{threads}, shared {kernel.metadata.shared}")
    if info["ptxas_rc"]:
        print(info["ptxas"])


def measure() -> None:
    """On sm_90: both GEMMs' input gradients against the library's default, bits and times, then the frozen MoE."""
    from csattn.ops.fp8 import quantize_1x128
    from csattn.ops.fp8.gluon import grouped_mm_gluon
    from lab.probes.gluon_forms import bench, frozen_moe_ms, moe_gemms

    dev = torch.device("cuda")
    for name, q, s, offs, m, gen in moe_gemms(dev):
        qa, sa = quantize_1x128(torch.randn(m, q.shape[1], device=dev, generator=gen, dtype=torch.bfloat16))
        base = grouped_mm_gluon(qa, sa, q, s, offs, True)
        got = input_grad_xpose3(qa, sa, q, s, offs)
        torch.cuda.synchronize()
        print(f"{name:16s} copier + two transposers equal to the library's: {torch.equal(got, base)}", flush=True)
        flop = 2.0 * m * q.shape[1] * q.shape[2]
        bench(name, "input gradient, library (SPLIT)", partial(grouped_mm_gluon, qa, sa, q, s, offs, True), flop)
        bench(name, "input gradient, copier + two transposers", partial(input_grad_xpose3, qa, sa, q, s, offs), flop)
    real = fp8_gluon.grouped_mm_gluon

    def swapped(a, a_scale, weight, scale, offs, trans=False, **kw):
        if trans and not kw.get("low_rank") and kw.get("out") is None and kw.get("settings") is None:
            return input_grad_xpose3(a, a_scale, weight, scale, offs)
        return real(a, a_scale, weight, scale, offs, trans, **kw)

    bf16 = frozen_moe_ms("bf16")
    for _turn in range(2):
        ms = frozen_moe_ms("fp8")
        with mock.patch.object(fp8_gluon, "grouped_mm_gluon", swapped):
            ms3 = frozen_moe_ms("fp8")
        print(f"frozen MoE (bf16 experts {bf16:.2f} ms): library {ms:.2f} ({bf16 / ms:.3f}x), copier + two "
              f"transposers {ms3:.2f} ({bf16 / ms3:.3f}x)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="store_true", help="build for sm_90 only (no GPU)")
    build() if ap.parse_args().build else measure()


if __name__ == "__main__":
    main()
