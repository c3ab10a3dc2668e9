"""The input gradient's weight-tile transposition by 16-bit matrix loads and stores (how FlashAttention-3 transposes
its FP8 ``V`` tile): the copied ``[128 K, 128 N]`` e4m3 tile read as ``[128, 64]`` 16-bit pairs by ``ldmatrix.trans``
(a thread gets 2 consecutive K rows of an N pair from each 8 x 8 matrix; the matrix rows chosen so that two matrices
give it 4 consecutive K), the bytes sorted in registers (``prmt``: 4 K bytes of one N), then written by ``stmatrix``
into the K-major tile viewed as ``[128 N, 64]`` pairs. In Gluon this is only a register layout for the loaded pairs
(:func:`pairs_layout`) and shape operations: Gluon keeps the semantics (a transposition, whatever the PTX), the
lowering chooses the instructions. The byte form (``lab.probes.fp8_xpose_words.bytes_layout``, the library's then)
reads 4 bytes and writes 16 a thread, 2-way bank-conflicting both ways.

Built for sm_90 and counted beside the other forms by ``lab.probes.fp8_xpose_words`` (this module keeps the form's
layout and permutes). Per thread and tile: 8 ``ldmatrix.x4.trans`` + 8 ``stmatrix.x4`` against 32 4-byte loads +
8 16-byte stores; in SASS 160 ``PRMT`` against 96 (the 16-bit pairs unpacked and packed again around the byte permutes).

Measured and not taken (the library's input gradient with it, as the setting ``LDSM``, at f8c07e3; H200, torch 2.11 /
Triton 3.6, ``lab/results/finetune_h200/{xpose_ldsm,gpu_tests_ldsm}_f8c07e3.txt``): bit for bit the default's (GPU
tests over the ragged / 16-step / all-tail cases, with and without LoRA's term: 6 passed), but slower, gate_up 6.35 /
6.13 ms against 5.81 / 5.99, down 3.13 / 3.05 against 2.89 / 2.99, the frozen MoE 17.43 / 17.24 against 16.84 / 17.01.
The transposers are bound by their instructions, not by shared memory's wavefronts. The code is in git at f8c07e3.

    PYTHONPATH=. python -m lab.probes.fp8_xpose_words
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


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
def sorted_pairs(x):
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
