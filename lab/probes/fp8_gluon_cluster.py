"""The Gluon FP8 forward with the weight tile shared by a cluster of two CTAs (TMA multicast): a draft for Triton > 3.6.
**Run on an H100 at 2dea5ed (Triton 3.9): "unspecified launch failure"** (``lab/results/finetune_h100/
cluster_{build,probe}_2dea5ed.txt``). Its PTX shows two wrong assumptions of the draft about Gluon's multi-CTA model:

- ``gl.program_id(0)`` is the cluster's id (``ctaid.x >> 1``), not the CTA's: ``% 2`` is the same in both CTAs, so
  ``lead`` does not tell them apart (and pairs of clusters walk the same tiles). Gluon 3.9 exposes no CTA rank.
- ``mbarrier.arrive(bar, from_cta=0)`` is a broadcast from CTA 0 to every CTA (its threads 0 and 1 arrive, one on
  each CTA's barrier: the address's bit 24 from ``tid.x & 1``, predicated on ``cluster_ctarank == 0``), not an
  arrival of each CTA on CTA 0's. With the multicast copy issued by CTA 0 alone, the producer there must hear from
  CTA 1's math warpgroups, which Gluon's Hopper ``arrive`` cannot route; it would take inline PTX (``mapa`` to CTA
  0's barrier and ``mbarrier.arrive.shared::cluster``), where Gluon gives no barrier address.

So the shared-stage protocol below does not hold; kept as the record of what was tried.

Why: at the MoE's shapes the forward's pipeline waits on its ring (the producer for free stages 58 % of its time, the
math warpgroups for landed ones 22 %: ``lab/ncu_source_session.sh``) and its tiles come from L2 at close to its
bandwidth; the promotion's second accumulator caps a CTA's tile at 128 x 128 or 64 x 256 (``gluon_wide``). Here two
CTAs take two 64-row tiles of one 128-row tile of a group (``gluon_wide``'s ``[64, 256]`` each, the same 256
columns): CTA 0 copies the ``[256, 128]`` weight tile once into both by multicast, each CTA its own ``[64, 128]``
activation tile. Bytes from L2 a step and CTA: 8 KB + 16 KB, against ``gluon_wide``'s 8 + 32. The rows' padding is
the 128-row tiles' (1.150x the routed rows at 256 experts top-6 and 16k tokens, against 1.075x). Each math
warpgroup's products, scales and promotion are ``gluon_wide``'s (the same per-CTA registers), so the output should
equal it bit for bit.

Gluon's multi-CTA model (see ``lab.probes.gluon_multicast_build``): the code is the cluster's, a tensor's shape the
cluster's, ``cga_layout`` splits or broadcasts it over the CTAs. ``program_id(0)`` is the CTA's (the launch's grid is
the clusters' times two): ``% 2`` is the CTA's rank in its cluster, ``// 2`` the cluster's.

The ring's barriers across the cluster: ``land`` (each CTA's own: its activation tile's bytes and its copy of the
weight tile's), ``empty`` (each CTA's own, its two math warpgroups: the activation tile's stage is free again) and
``shared_free`` (CTA 0's, all four math warpgroups, each arriving there with ``from_cta=0``: the weight tile's stage
is free in both CTAs). CTA 0's producer waits for both before its copies, CTA 1's for ``empty`` only (its wait on
``shared_free``, which nobody arrives at in CTA 1, is predicated off). A CTA leaves only after a cluster barrier:
the other may still arrive at its barriers.

    python -m lab.probes.fp8_gluon_cluster --build     # anywhere with Triton > 3.6: the sm_90 PTX's facts
    python -m lab.probes.fp8_gluon_cluster             # sm_90 with Triton > 3.6: bits against gluon_wide, times
"""

from __future__ import annotations

import argparse
import re
from functools import partial

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import cluster, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from csattn.ops.fp8.gluon import _LOWER, _UPPER, _scales, prepared
from csattn.ops.fp8.gluon_tiles import BK, _tile, tile_walk

ROWS_C: gl.constexpr = gl.constexpr(128)  # a cluster's rows: 64 a CTA
TN: gl.constexpr = gl.constexpr(256)  # columns of a tile: a 128-column block a math warpgroup
SPLIT_ROWS = gl.constexpr([[1, 0]])  # a 2-D tensor's rows split over the two CTAs
SHARED = gl.constexpr([[0, 0]])  # the same 2-D tensor in both CTAs


@gluon.constexpr_function
def smem_layout(cga):
    """The 128-byte-swizzled FP8 tile layout, split or shared over the cluster by ``cga``."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2, cga_layout=cga)


@gluon.constexpr_function
def acc_layout():
    """A math warpgroup's accumulator ``[128, 128]`` over the cluster: each CTA its 64 rows (``m64n128``)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32],
                                     cga_layout=SPLIT_ROWS)


@gluon.jit
def _producer(a_desc, w_desc, table, KC, E, W_ROWS, tiles_m, tiles_n, smem, E_P2: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """Every TMA copy: each CTA its ``[64, 128]`` activation tile, CTA 0 the ``[256, 128]`` weight tile into both."""
    a_smem, b_smem, land, empty, shared_free = smem
    lead = gl.program_id(0) % 2 == 0
    nk = KC // BK
    it = 0
    for t in range(gl.program_id(0) // 2, tiles_m * tiles_n, gl.num_programs(0) // 2):
        g, row0, row_end, pid_n = _tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M, TILE_M=ROWS_C, CTAS=2)
        if g < E:
            for kb in range(nk):
                s = it % STAGES
                phase = ((it // STAGES) & 1) ^ 1  # the first pass over the ring: at once
                mbarrier.wait(empty.index(s), phase)
                mbarrier.wait(shared_free.index(s), phase, pred=lead)
                mbarrier.expect(land.index(s), a_desc.nbytes_per_cta + w_desc.nbytes_per_cta)
                tma.async_load(a_desc, [row0, kb * BK], land.index(s), a_smem.index(s))
                tma.async_load(w_desc, [g * W_ROWS + pid_n * TN, kb * BK], land.index(s), b_smem.index(s),
                               multicast=True)
                it += 1


@gluon.jit
def _issue(a_smem, b_smem, land, zero, j, HALF: gl.constexpr, STAGES: gl.constexpr):
    """Once stage ``j`` landed, start its product: the tile's rows by this warpgroup's 128 columns."""
    s = j % STAGES
    mbarrier.wait(land.index(s), (j // STAGES) & 1)
    return warpgroup_mma(a_smem.index(s), b_smem.index(s).slice(HALF * 128, 128, dim=0).permute((1, 0)), zero,
                         use_acc=False, is_async=True)


@gluon.jit
def _promote(acc, tok, sc, empty, shared_free, j, PENDING: gl.constexpr, STAGES: gl.constexpr):
    """``gluon._promote``, the stage freed in this CTA (``empty``) and for the shared tile at CTA 0."""
    part = warpgroup_mma_wait(PENDING, deps=[tok])
    mbarrier.arrive(empty.index(j % STAGES))
    mbarrier.arrive(shared_free.index(j % STAGES), from_cta=0)
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc + part * gl.expand_dims(sc, 1)],
                                     dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _contract(acc, zero, smem, sa_ptrs, sw_ptr, rmask, it, nk, stride_sak, stride_sbk, HALF: gl.constexpr,
              STAGES: gl.constexpr):
    """``gluon._contract``'s rounds of four steps (the next product started before the last one is promoted)."""
    a_smem, b_smem, land, empty, shared_free = smem
    for r in range(0, nk // 4):
        j = it + 4 * r
        sc0 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r, stride_sak, stride_sbk)
        t0 = _issue(a_smem, b_smem, land, zero, j, HALF, STAGES)
        sc1 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r + 1, stride_sak, stride_sbk)
        t1 = _issue(a_smem, b_smem, land, zero, j + 1, HALF, STAGES)
        acc = _promote(acc, t0, sc0, empty, shared_free, j, 1, STAGES)
        sc2 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r + 2, stride_sak, stride_sbk)
        t2 = _issue(a_smem, b_smem, land, zero, j + 2, HALF, STAGES)
        acc = _promote(acc, t1, sc1, empty, shared_free, j + 1, 1, STAGES)
        sc3 = _scales(sa_ptrs, sw_ptr, rmask, 4 * r + 3, stride_sak, stride_sbk)
        t3 = _issue(a_smem, b_smem, land, zero, j + 3, HALF, STAGES)
        acc = _promote(acc, t2, sc2, empty, shared_free, j + 2, 1, STAGES)
        acc = _promote(acc, t3, sc3, empty, shared_free, j + 3, 0, STAGES)
    for kb in range(nk // 4 * 4, nk):
        sc0 = _scales(sa_ptrs, sw_ptr, rmask, kb, stride_sak, stride_sbk)
        t0 = _issue(a_smem, b_smem, land, zero, it + kb, HALF, STAGES)
        acc = _promote(acc, t0, sc0, empty, shared_free, it + kb, 0, STAGES)
    return acc


@gluon.jit
def _store(out, acc, first_row, row_end, block, stride_om):
    """``gluon._store`` (through shared memory into 16-byte stores), each CTA its 64 rows."""
    OUT: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0], cga_layout=SPLIT_ROWS)
    val = gl.convert_layout(acc.to(out.dtype.element_ty), OUT)
    rows = first_row + gl.arange(0, 128, layout=gl.SliceLayout(1, OUT))
    cols = block * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, OUT))
    ptrs = out + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, val, mask=gl.expand_dims(rows < row_end, 1))


@gluon.jit
def _math(sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe, stride_sbk, stride_sbn,
          stride_om, smem, HALF: gl.constexpr, E_P2: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """Math warpgroup ``HALF``: the cluster tile's 128 rows (each CTA its 64) by columns ``[128 HALF, 128 HALF +
    128)``."""
    ACC: gl.constexpr = acc_layout()
    zero = gl.zeros([128, 128], gl.float32, layout=ACC)
    nk = KC // BK
    it = 0
    for t in range(gl.program_id(0) // 2, tiles_m * tiles_n, gl.num_programs(0) // 2):
        g, row0, row_end, pid_n = _tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M, TILE_M=ROWS_C, CTAS=2)
        block = pid_n * 2 + HALF
        if g < E:
            rows = row0 + gl.arange(0, 128, layout=gl.SliceLayout(1, ACC))
            rmask = rows < row_end
            sa_ptrs = sa + rows.to(gl.int64) * stride_sam
            sw_ptr = sw + g.to(gl.int64) * stride_swe + block * stride_sbn
            acc = _contract(zero, zero, smem, sa_ptrs, sw_ptr, rmask, it, nk, stride_sak, stride_sbk, HALF, STAGES)
            it += nk
            _store(out, acc, row0, row_end, block, stride_om)
        elif g == E:  # rows past offs[-1]
            _store(out, zero, row0, row_end, block, stride_om)


@gluon.jit
def fp8_cluster_forward_kernel(a_desc, w_desc, sa, sw, table, out, KC, E, W_ROWS, tiles_m, tiles_n, stride_sam,
                               stride_sak, stride_swe, stride_sbk, stride_sbn, stride_om, E_P2: gl.constexpr,
                               GROUP_M: gl.constexpr, STAGES: gl.constexpr, MATH_REGS: gl.constexpr,
                               PRODUCER_REGS: gl.constexpr):
    """``out[rows of e] = a[rows of e] @ W_e^T`` (``gluon_wide``'s forward without LoRA's term), a cluster of two on
    each ``[128, 256]`` tile; ``a_desc`` blocks ``[128, 128]`` split by rows, ``w_desc`` ``[256, 128]`` shared."""
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, ROWS_C, BK], smem_layout(SPLIT_ROWS))
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, TN, BK], smem_layout(SHARED))
    land = mbarrier.allocate_mbarrier(batch=STAGES)
    empty = mbarrier.allocate_mbarrier(batch=STAGES)
    shared_free = mbarrier.allocate_mbarrier(batch=STAGES)
    for s in gl.static_range(STAGES):
        mbarrier.init(land.index(s), count=1)  # the expect; the copies' bytes
        mbarrier.init(empty.index(s), count=2)  # this CTA's math warpgroups
        mbarrier.init(shared_free.index(s), count=4)  # both CTAs' (at CTA 0)
    smem = (a_smem, b_smem, land, empty, shared_free)
    gl.warp_specialize([
        (_math, (sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe, stride_sbk,
                 stride_sbn, stride_om, smem, _UPPER, E_P2, GROUP_M, STAGES)),
        (_math, (sa, sw, table, out, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe, stride_sbk,
                 stride_sbn, stride_om, smem, _LOWER, E_P2, GROUP_M, STAGES)),
        (_producer, (a_desc, w_desc, table, KC, E, W_ROWS, tiles_m, tiles_n, smem, E_P2, GROUP_M, STAGES)),
    ], [4, 4], [MATH_REGS, PRODUCER_REGS])
    cluster.barrier()  # the other CTA may still arrive at this one's barriers


# the math warpgroups hold the remote arrivals' addresses beside the kernel's registers: at 232 they spilled 72
# bytes (Triton 3.9)
SETTINGS = dict(GROUP_M=8, STAGES=4, MATH_REGS=240, PRODUCER_REGS=24)


def cluster_forward(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                    settings: dict | None = None) -> torch.Tensor:
    """``gluon_wide.grouped_mm_gluon_wide``'s forward (no low-rank term) on clusters of two: ``a`` e4m3 ``[M, K]``
    with its 1x128 scales, ``weight`` e4m3 ``[E, N, K]`` (``N`` a multiple of 256) and its 128x128 scales."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    m, c = a.shape
    e, n_w, k_w = weight.shape
    a, a_scale, weight, scale, out = prepared(a, a_scale, weight, scale, None, n_w, out_dtype)
    walk = tile_walk(offs, m, n_w, ROWS_C.value, TN.value)
    a_desc = TensorDescriptor(a, [m, c], [c, 1], [ROWS_C.value, BK.value], smem_layout(SPLIT_ROWS.value))
    w_desc = TensorDescriptor(weight.view(e * n_w, k_w), [e * n_w, k_w], [k_w, 1], [TN.value, BK.value],
                              smem_layout(SHARED.value))
    clusters = max(1, walk.grid[0] // 2)
    fp8_cluster_forward_kernel[(clusters,)](
        a_desc, w_desc, a_scale, scale, walk.table, out, c, e, n_w, walk.tiles_m, walk.tiles_n, a_scale.stride(0),
        a_scale.stride(1), scale.stride(0), scale.stride(2), scale.stride(1), out.stride(0), E_P2=walk.e_p2,
        **{**SETTINGS, **(settings or {})}, num_warps=4, num_ctas=2)
    return out


def build() -> None:
    """The kernel for sm_90 without a GPU (``tests.ops.gluon_sm90.build_sm90``): ptxas's spills, the copies, MMAs,
    cluster and shared memory."""
    from tests.ops.gluon_sm90 import build_sm90

    a_l, w_l = smem_layout(SPLIT_ROWS.value), smem_layout(SHARED.value)
    ints = ("KC", "E", "W_ROWS", "tiles_m", "tiles_n", "stride_sam", "stride_sak", "stride_swe", "stride_sbk",
            "stride_sbn", "stride_om")
    sig = {"a_desc": f"tensordesc<fp8e4nv[128, 128],{a_l!r}>", "w_desc": f"tensordesc<fp8e4nv[256, 128],{w_l!r}>",
           "sa": "*fp32", "sw": "*fp32", "table": "*i32", "out": "*bf16", **{k: "i32" for k in ints}}
    aligned = [k for k, v in sig.items() if v.startswith("*")] + ["stride_om"]
    kernel, ptx, info = build_sm90(fp8_cluster_forward_kernel, sig, dict(E_P2=512, **SETTINGS), aligned, num_ctas=2)
    serialized = any(c in info["ptxas"] for c in ("C7514", "C7512", "C7517"))
    print(f"triton {triton.__version__}; ptxas rc {info['ptxas_rc']}; spill stores {info['spill_stores']}; "
          f"serialized {serialized}")
    print("TMA copies:", sorted(set(re.findall(r"cp\.async\.bulk\.tensor[^\s]*", ptx))))
    print("MMAs:", sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)", ptx))),
          "waits:", sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx))))
    print("remote arrivals:", len(re.findall(r"mbarrier\.arrive[^\n]*shared::cluster", ptx)),
          "cluster:", re.findall(r"\.reqnctapercluster[^\n]*", ptx), "shared bytes a CTA:", kernel.metadata.shared)
    if info["ptxas_rc"]:
        print(info["ptxas"])


def measure() -> None:
    """On sm_90: the output against ``gluon_wide``'s (bit for bit), then both timed at the MoE's forwards."""
    from csattn.ops.fp8.gluon_wide import grouped_mm_gluon_wide
    from lab.probes.gluon_forms import bench, forward_cases

    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    for name, q, s, offs, m in forward_cases(dev, gen, ((16384, 4096, 2048),)):
        from csattn.ops.fp8 import quantize_1x128

        qa, sa = quantize_1x128(torch.randn(m, q.shape[2], device=dev, generator=gen, dtype=torch.bfloat16))
        flop = 2.0 * m * q.shape[1] * q.shape[2]
        base = grouped_mm_gluon_wide(qa, sa, q, s, offs)
        got = cluster_forward(qa, sa, q, s, offs)
        torch.cuda.synchronize()
        print(f"{name:16s} cluster of two equal to gluon_wide: {torch.equal(got, base)}", flush=True)
        bench(name, "gluon_wide 64 x 256", partial(grouped_mm_gluon_wide, qa, sa, q, s, offs), flop)
        bench(name, "cluster of two, weight multicast", partial(cluster_forward, qa, sa, q, s, offs), flop)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="store_true", help="build for sm_90 only (no GPU)")
    args = ap.parse_args()
    build() if args.build else measure()


if __name__ == "__main__":
    main()
