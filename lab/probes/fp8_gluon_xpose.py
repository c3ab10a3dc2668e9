"""Where the Gluon FP8 grouped GEMM's input gradient (``trans``) loses to its forward: the kernel of
``csattn.ops.fp8.gluon`` with the producer's transposition switched by ``XPOSE`` (H200; prequantized operands at the
MoE shapes: 256 experts top-6, 16k tokens, D 4096, I 2048).

- 0: the library's transposition (its register layout: ``ldmatrix`` reads, 16-byte stores 4-way conflicting);
- 1: none (the weight tile as copied, marked ready at once: the product is wrong, its time is the bound);
- 2: stores only (zeros, in layout 3's pattern; wrong product);
- 3: a layout 2-way conflicting both ways (a thread: 16 rows by 4 bytes; lanes: one row bit, then the words);
- 4, 5, 8: a transposer warpgroup of its own (layouts 3, 0, 7) and a one-warp partition issuing the copies;
- 6: layout 3 with both pieces loaded before the first store;
- 7: virtual coordinates through linear shared layouts: no conflict either way;
- 9: layout 3 with its lanes reordered so that Triton reads it with ``ldmatrix``; 10: 9 in a transposer of its own.

Each case: ms, TFLOP/s and whether the output equals the library kernel's (cases 0 and 3 must).
Run on an H200: python -m lab.probes.fp8_gluon_xpose"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

import csattn.ops.fp8.gluon as lib
from csattn.ops.fp8 import quantize_1x128
from csattn.ops.moe import route_plan

BM, BN, BK = lib.BM, lib.BN, lib.BK
_UPPER = gl.constexpr(0)
_LOWER = gl.constexpr(1)


@gluon.constexpr_function
def conflict2_layout():
    """A ``[128, 64]`` piece (rows: the contraction ``n``, columns ``k``): a thread holds rows ``{0..3, 4, 8}`` by
    bytes ``{0..3}``; lane bit 0 moves 16 rows, the others the 4-byte words; warps 32 and 64 rows."""
    return gl.DistributedLinearLayout(reg_bases=[[1, 0], [2, 0], [0, 1], [0, 2], [4, 0], [8, 0]],
                                      lane_bases=[[16, 0], [0, 4], [0, 8], [0, 16], [0, 32]],
                                      warp_bases=[[32, 0], [64, 0]], block_bases=[], shape=[128, 64])


@gluon.constexpr_function
def ldmatrix_layout():
    """Layout 3 with its lanes reordered (the 4-byte words first, then the 16-row step): Triton reads it with
    ``ldmatrix`` (16 bytes a thread an instruction, four times fewer loads), both ways 2-way conflicting as 3."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0], [8, 0]],
                                      lane_bases=[[0, 4], [0, 8], [16, 0], [0, 16], [0, 32]],
                                      warp_bases=[[32, 0], [64, 0]], block_bases=[], shape=[128, 64])


# 7: virtual coordinates. The register tensor is a plain blocked layout over (x, y); shared memory is read and
# written through linear layouts that put the element (x, y) at the weight's (n, k) = (x ^ A(y), y), A(y) moving n by
# 16 and 32 with y's bits 3 and 4. A thread holds 16 rows by 4 bytes; lanes walk the 4-byte words, and two of them
# also move 16 / 32 rows: the 4-byte loads and the 16-byte stores each fill a wavefront (no conflict either way).
RAW_V = [[0, 1], [0, 2], [0, 4], [16, 8], [32, 16], [0, 32], [0, 64], [33, 16], [2, 32], [4, 64], [8, 0], [16, 0],
         [32, 0], [64, 0]]
BT_V = [[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32], [0, 64], [1, 16], [2, 32], [4, 64], [8, 16], [16, 32],
        [32, 0], [64, 0]]
_reinterpret = getattr(gl.shared_memory_descriptor, "reinterpret", None) or gl.shared_memory_descriptor._reinterpret


@gluon.constexpr_function
def virtual_layout():
    return gl.DistributedLinearLayout(reg_bases=[[1, 0], [2, 0], [4, 0], [8, 0], [0, 1], [0, 2]],
                                      lane_bases=[[0, 4], [0, 8], [0, 16], [0, 32], [0, 64]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 128])


@gluon.constexpr_function
def raw_virtual():
    return gl.SharedLinearLayout(offset_bases=RAW_V)


@gluon.constexpr_function
def bt_virtual():
    return gl.SharedLinearLayout(offset_bases=BT_V)


@gluon.jit
def _transpose_stage(j, raw, bt, land, ready, STAGES: gl.constexpr, XPOSE: gl.constexpr):
    s = j % STAGES
    mbarrier.wait(land.index(s), (j // STAGES) & 1)
    if XPOSE == 0:
        for c in gl.static_range(2):
            piece = raw.index(s).slice(c * 64, 64, dim=1).load(lib.transpose_layout())
            bt.index(s).slice(c * 64, 64, dim=0).store(gl.permute(piece, (1, 0)))
    elif XPOSE == 2:
        for c in gl.static_range(2):
            zero = gl.zeros([128, 64], gl.float8e4nv, layout=conflict2_layout())
            bt.index(s).slice(c * 64, 64, dim=0).store(gl.permute(zero, (1, 0)))
    elif XPOSE == 3:
        for c in gl.static_range(2):
            piece = raw.index(s).slice(c * 64, 64, dim=1).load(conflict2_layout())
            bt.index(s).slice(c * 64, 64, dim=0).store(gl.permute(piece, (1, 0)))
    elif XPOSE == 7:
        rv = _reinterpret(raw.index(s), gl.float8e4nv, [128, 128], raw_virtual())
        bv = _reinterpret(bt.index(s), gl.float8e4nv, [128, 128], bt_virtual())
        for c in gl.static_range(2):
            piece = rv.slice(c * 64, 64, dim=0).load(virtual_layout())
            bv.slice(c * 64, 64, dim=1).store(gl.permute(piece, (1, 0)))
    elif XPOSE == 9:
        for c in gl.static_range(2):
            piece = raw.index(s).slice(c * 64, 64, dim=1).load(ldmatrix_layout())
            bt.index(s).slice(c * 64, 64, dim=0).store(gl.permute(piece, (1, 0)))
    elif XPOSE == 6:  # layout 3, both pieces' loads issued before the first store
        p0 = raw.index(s).slice(0, 64, dim=1).load(conflict2_layout())
        p1 = raw.index(s).slice(64, 64, dim=1).load(conflict2_layout())
        bt.index(s).slice(0, 64, dim=0).store(gl.permute(p0, (1, 0)))
        bt.index(s).slice(64, 64, dim=0).store(gl.permute(p1, (1, 0)))
    fence_async_shared()
    lib._cta_sync()
    mbarrier.arrive(ready.index(s), count=1)


@gluon.jit
def _producer(a_desc, w_desc, table, M, KC, E, W_ROWS, tiles_m, tiles_n, smem,
              TRANS: gl.constexpr, E_P2: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              LAG: gl.constexpr, XPOSE: gl.constexpr, WARPS: gl.constexpr = 4):
    """The library's producer with transposition ``XPOSE``; where a transposer of its own runs (``XPOSE`` 4, 5,
    8, 10) the copies alone, in a one-warp partition (``WARPS`` 1): a stage is reused once the math warpgroups
    are done with it, which is after the transposer read its weight tile."""
    a_smem, raw, bt, land, ready, empty, _scale_stages = smem
    OWN: gl.constexpr = XPOSE == 4 or XPOSE == 5 or XPOSE == 8 or XPOSE == 10
    nk = KC // BK
    it = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        g, row0, row_end, pid_n = lib._tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M, WARPS)
        if g < E:
            for kb in range(nk):
                if not OWN and it >= LAG:
                    _transpose_stage(it - LAG, raw, bt, land, ready, STAGES, XPOSE)
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(land.index(s), BM * BK + BK * BN)
                lib._tma_load(a_desc, [row0, kb * BK], land.index(s), a_smem.index(s))
                lib._tma_load(w_desc, [g * W_ROWS + kb * BK, pid_n * BN], land.index(s), raw.index(s))
                it += 1
    if not OWN:
        for j in range(gl.maximum(it - LAG, 0), it):
            _transpose_stage(j, raw, bt, land, ready, STAGES, XPOSE)


@gluon.jit
def _transposer(table, KC, E, tiles_m, tiles_n, smem, E_P2: gl.constexpr, GROUP_M: gl.constexpr,
                STAGES: gl.constexpr, XPOSE: gl.constexpr):
    """Every landed weight tile transposed as soon as it lands (``XPOSE`` 4: layout 3; 5: the library's; 8: 7)."""
    a_smem, raw, bt, land, ready, empty, _scale_stages = smem
    nk = KC // BK
    it = 0
    for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        g, row0, row_end, pid_n = lib._tile(t, table, tiles_m, tiles_n, E_P2, GROUP_M)
        if g < E:
            for _ in range(nk):
                if XPOSE == 4:
                    _transpose_stage(it, raw, bt, land, ready, STAGES, 3)
                elif XPOSE == 8:
                    _transpose_stage(it, raw, bt, land, ready, STAGES, 7)
                elif XPOSE == 10:
                    _transpose_stage(it, raw, bt, land, ready, STAGES, 9)
                else:
                    _transpose_stage(it, raw, bt, land, ready, STAGES, 0)
                it += 1


@gluon.jit
def fp8_grouped_gluon_kernel(
    a_desc, w_desc, sa, sw, table, out, M, N, KC, E, W_ROWS, tiles_m, tiles_n,
    stride_sam, stride_sak, stride_swe, stride_sbk, stride_sbn, stride_om, v_desc, lw_desc, l_scale, sa_desc,
    TRANS: gl.constexpr, E_P2: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, LAG: gl.constexpr,
    MATH_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, XPOSE: gl.constexpr, XREGS: gl.constexpr,
    TMA_REGS: gl.constexpr, LOW_RANK: gl.constexpr = False, SWAP: gl.constexpr = False,
    SCALES_TMA: gl.constexpr = False,
):
    """The library kernel's signature (no low-rank term here: ``LOW_RANK`` stays False) and its partitions, the
    producer's transposition switched by ``XPOSE``."""
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BM, BK], lib.tile_smem())
    raw = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BK, BN], lib.tile_smem())
    if XPOSE == 1:
        bt = raw
    else:
        bt = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, BK], lib.tile_smem())
    land = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(land.index(s), count=1)
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    smem = (a_smem, raw, bt, land, ready, empty, a_smem)  # the last: the library's scale stages (SWAP only)
    low_rank = (v_desc, lw_desc, l_scale, a_smem, a_smem, land, empty)  # unused: the library's placeholder
    if XPOSE == 4 or XPOSE == 5 or XPOSE == 8 or XPOSE == 10:
        gl.warp_specialize([
            (lib._math, (sa, sw, table, out, M, N, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe,
                         stride_sbk, stride_sbn, stride_om, smem, low_rank, _UPPER, TRANS, E_P2, GROUP_M, STAGES,
                         False)),
            (lib._math, (sa, sw, table, out, M, N, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe,
                         stride_sbk, stride_sbn, stride_om, smem, low_rank, _LOWER, TRANS, E_P2, GROUP_M, STAGES,
                         False)),
            (_transposer, (table, KC, E, tiles_m, tiles_n, smem, E_P2, GROUP_M, STAGES, XPOSE)),
            (_producer, (a_desc, w_desc, table, M, KC, E, W_ROWS, tiles_m, tiles_n, smem, TRANS, E_P2, GROUP_M,
                         STAGES, LAG, XPOSE, 1)),
        ], [4, 4, 1], [MATH_REGS, XREGS, TMA_REGS])
    else:
        gl.warp_specialize([
            (lib._math, (sa, sw, table, out, M, N, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe,
                         stride_sbk, stride_sbn, stride_om, smem, low_rank, _UPPER, TRANS, E_P2, GROUP_M, STAGES,
                         False)),
            (lib._math, (sa, sw, table, out, M, N, KC, E, tiles_m, tiles_n, stride_sam, stride_sak, stride_swe,
                         stride_sbk, stride_sbn, stride_om, smem, low_rank, _LOWER, TRANS, E_P2, GROUP_M, STAGES,
                         False)),
            (_producer, (a_desc, w_desc, table, M, KC, E, W_ROWS, tiles_m, tiles_n, smem, TRANS, E_P2, GROUP_M,
                         STAGES, LAG, XPOSE)),
        ], [4, 4], [MATH_REGS, PRODUCER_REGS])


def timed(call, flops: float) -> str:
    ms = triton.testing.do_bench(call, warmup=10, rep=60)
    return f"{ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s"


def one_gemm(name: str, n_w: int, k_w: int, offs: torch.Tensor, m: int, g: torch.Generator) -> None:
    """The library kernel, the forward kernel on a resident transposed copy, then each variant."""
    library = lib.fp8_grouped_gluon_kernel
    q = (torch.randn(e_, n_w, k_w, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(e_, n_w // 128, k_w // 128, device="cuda", generator=g) * 1e-3 + 1e-3
    qa, sa = quantize_1x128(torch.randn(m, n_w, device="cuda", generator=g).bfloat16())
    flops = 2 * m * n_w * k_w
    qt, st = q.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous()
    ref = lib.grouped_mm_gluon(qa, sa, q, s, offs, True)
    print(f"{name} library: {timed(lambda: lib.grouped_mm_gluon(qa, sa, q, s, offs, True), flops)}")
    same = torch.equal(lib.grouped_mm_gluon(qa, sa, qt, st, offs), ref)
    print(f"{name} forward kernel on a resident transposed copy: "
          f"{timed(lambda: lib.grouped_mm_gluon(qa, sa, qt, st, offs), flops)}, equal: {same}")
    lib.fp8_grouped_gluon_kernel = fp8_grouped_gluon_kernel
    try:
        for xpose, lag in ((1, 2), (3, 2), (9, 2), (9, 3), (4, 0), (8, 0), (10, 0)):
            # the math warpgroups at 224 registers (232 in the library): the producer needs 64 where it holds a
            # piece in layout 3 or 7 (48: spills); a transposer of its own (4, 5, 8) gets 40 and the copies 24
            settings = {"XPOSE": xpose, "LAG": lag, "MATH_REGS": 224, "PRODUCER_REGS": 64, "XREGS": 40,
                        "TMA_REGS": 24}
            tag = f"{name} XPOSE={xpose} LAG={lag}"
            try:
                out = lib.grouped_mm_gluon(qa, sa, q, s, offs, True, settings=settings)
                time = timed(lambda settings=settings: lib.grouped_mm_gluon(qa, sa, q, s, offs, True,
                                                                            settings=settings), flops)
                print(f"{tag}: {time}, equal to the library: {torch.equal(out, ref)}")
            except Exception as err:  # noqa: BLE001 (a variant that does not build is reported, the others run)
                print(f"{tag}: failed: {type(err).__name__}: {str(err)[:300]}")
    finally:
        lib.fp8_grouped_gluon_kernel = library


e_ = 256


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, k, d, inter = 16384, 6, 4096, 2048
    ids = torch.topk(torch.randn(tokens, e_, device="cuda", generator=g), k, dim=-1).indices
    offs = route_plan(ids, e_).offs
    one_gemm("gate_up_t", 2 * inter, d, offs, tokens * k, g)
    one_gemm("down_t", d, inter, offs, tokens * k, g)


if __name__ == "__main__":
    main()
