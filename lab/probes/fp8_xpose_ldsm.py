"""The input gradient's weight-tile transposition by 16-bit matrix loads and stores (how FlashAttention-3 transposes
its FP8 ``V`` tile): the copied ``[128 K, 128 N]`` e4m3 tile read as ``[128, 64]`` 16-bit pairs by ``ldmatrix.trans``
(a thread gets 2 consecutive K rows of an N pair from each 8 x 8 matrix; the matrix rows chosen so that two matrices
give it 4 consecutive K), the bytes sorted in registers (``prmt``: 4 K bytes of one N), then written by ``stmatrix``
into the K-major tile viewed as ``[128 N, 64]`` pairs. In Gluon this is only a register layout for the loaded pairs
(:func:`pairs_layout`) and shape operations: Gluon keeps the semantics (a transposition, whatever the PTX), the
lowering chooses the instructions. The byte form (``lab.probes.fp8_xpose_words.bytes_layout``, the library's then)
reads 4 bytes and writes 16 a thread, 2-way bank-conflicting both ways.

Here, on any machine: both built for sm_90 in a kernel that transposes one tile, and their shared-memory
instructions counted from the PTX (``ldmatrix`` / ``stmatrix`` / plain loads and stores by width). Per thread and
tile: 8 ``ldmatrix.x4.trans`` + 8 ``stmatrix.x4`` against 32 4-byte loads + 8 16-byte stores; in SASS 160 ``PRMT``
against 96 (the 16-bit pairs unpacked and packed again around the byte permutes).

Measured and not taken (the library's input gradient with it, as the setting ``LDSM``, at f8c07e3; H200, torch 2.11 /
Triton 3.6, ``lab/results/finetune_h200/{xpose_ldsm,gpu_tests_ldsm}_f8c07e3.txt``): bit for bit the default's (GPU
tests over the ragged / 16-step / all-tail cases, with and without LoRA's term: 6 passed), but slower, gate_up 6.35 /
6.13 ms against 5.81 / 5.99, down 3.13 / 3.05 against 2.89 / 2.99, the frozen MoE 17.43 / 17.24 against 16.84 / 17.01.
The transposers are bound by their instructions, not by shared memory's wavefronts. The code is in git at f8c07e3.

    PYTHONPATH=. python -m lab.probes.fp8_xpose_ldsm
"""

from __future__ import annotations

import json
import re

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from csattn.ops.fp8.gluon_tiles import tile_smem
from lab.probes.fp8_xpose_words import bytes_layout


@gluon.constexpr_function
def pairs_layout():
    """Register layout of the tile's ``[128 K, 64 P]`` 16-bit pairs as ``ldmatrix.trans`` delivers them: a register's
    two pairs are rows K and K + 1 (bit 0 of K), a second matrix gives K + 2 (4 consecutive K a thread), the lanes'
    bits 0-1 walk K by 4 and 8 and bits 2-4 the pairs; more registers cover K by 16-64 and P by 8, the warps P by 16
    and 32."""
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [16, 0], [32, 0], [64, 0], [0, 8]],
        lane_bases=[[4, 0], [8, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 16], [0, 32]], block_bases=[], shape=[128, 64])


@gluon.jit
def _sorted_pairs(x):
    """``x [128 K, 64 P]`` int16 pairs (bytes N = 2P, 2P + 1 of row K) -> ``[128 N, 64 Q]`` int16 pairs of the
    transposed tile (bytes K = 2Q, 2Q + 1 of row N)."""
    w = gl.reshape(x.to(gl.int32), [64, 2, 64])  # (Q, K bit 0, P)
    even, odd = gl.split(gl.permute(w, (0, 2, 1)))  # rows K = 2Q and 2Q + 1: [64 Q, 64 P]
    # one byte permute each: the low bytes of both rows (row N = 2P), the high bytes (row N = 2P + 1)
    lo = gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x40;", "=r,r,r", [even, odd], dtype=gl.int32,
                                   is_pure=True, pack=1)
    hi = gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x51;", "=r,r,r", [even, odd], dtype=gl.int32,
                                   is_pure=True, pack=1)
    y = gl.permute(gl.join(lo, hi), (1, 2, 0))  # [64 P, 2 N bit 0, 64 Q]
    return gl.reshape(y, [128, 64]).to(gl.int16)


@gluon.jit
def xpose_kernel(src, dst, LDSM: gl.constexpr):
    """One ``[128, 128]`` e4m3 tile from ``src`` (row-major) into shared memory, transposed there, out to ``dst``."""
    BL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, 128, layout=gl.SliceLayout(1, BL))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, BL))
    at = gl.expand_dims(rows, 1) * 128 + gl.expand_dims(cols, 0)
    raw = gl.allocate_shared_memory(gl.float8e4nv, [128, 128], tile_smem())
    bt = gl.allocate_shared_memory(gl.float8e4nv, [128, 128], tile_smem())
    raw.store(gl.load(src + at))
    gl.thread_barrier() if hasattr(gl, "thread_barrier") else gl.barrier()
    if LDSM:
        p16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        x = (raw.reinterpret if hasattr(raw, "reinterpret") else raw._reinterpret)(gl.int16, [128, 64], p16)
        bt16 = (bt.reinterpret if hasattr(bt, "reinterpret") else bt._reinterpret)(gl.int16, [128, 64], p16)
        bt16.store(_sorted_pairs(x.load(pairs_layout())))
    else:
        for c in gl.static_range(2):
            piece = raw.slice(c * 64, 64, dim=1).load(bytes_layout())
            bt.slice(c * 64, 64, dim=0).store(gl.permute(piece, (1, 0)))
    gl.thread_barrier() if hasattr(gl, "thread_barrier") else gl.barrier()
    gl.store(dst + at, bt.load(BL))


def build(ldsm: bool) -> dict:
    from tests.ops.gluon_sm90 import build_sm90

    kernel, ptx, info = build_sm90(xpose_kernel, {"src": "*fp8e4nv", "dst": "*fp8e4nv"}, dict(LDSM=ldsm),
                                   ["src", "dst"])
    body = ptx
    count = {name: len(re.findall(pat, body)) for name, pat in {
        "ldmatrix": r"ldmatrix\.sync", "ldmatrix_trans": r"ldmatrix\.sync\.aligned\.m8n8\.x\d\.trans",
        "stmatrix": r"stmatrix\.sync", "ld_shared_b8": r"ld\.shared\.(?:b8|u8)",
        "ld_shared_b16": r"ld\.shared\.(?:b16|u16)",
        "ld_shared_b32": r"ld\.shared\.b32", "ld_shared_v2": r"ld\.shared\.v2", "ld_shared_v4": r"ld\.shared\.v4",
        "st_shared_b8": r"st\.shared\.(?:b8|u8)", "st_shared_b16": r"st\.shared\.(?:b16|u16)",
        "st_shared_b32": r"st\.shared\.b32", "st_shared_v2": r"st\.shared\.v2", "st_shared_v4": r"st\.shared\.v4",
        "prmt": r"prmt\.b32", "shfl": r"shfl\.sync"}.items()}
    return {"ldsm": ldsm, "ptxas_rc": info["ptxas_rc"], "spills": info["spill_stores"], **count}


def main() -> None:
    for ldsm in (False, True):
        try:
            print(json.dumps(build(ldsm)), flush=True)
        except Exception as err:  # the lowering may refuse a layout
            print(json.dumps({"ldsm": ldsm, "error": f"{type(err).__name__}: {str(err)[-600:]}"}), flush=True)


if __name__ == "__main__":
    main()
