"""The input gradient's weight-tile transposition with the byte permutes written out (``gluon.transpose_words``, the
library's since 780aa4a): the copied ``[128 K, 128 N]`` e4m3 tile read as 4-byte words (a thread: 16 K rows of one
word), each 4 x 4 block of bytes (4 K rows by the word's 4 N) transposed by 8 ``prmt`` (two rounds of 4: pairs of
rows interleaved, then pairs of pairs), and the words written K-major, 4 consecutive words (16 bytes) a store. The
form before it (here :func:`bytes_layout`) loaded the same bytes and left the sorting to the lowering of
``gl.permute``: 96 ``PRMT`` a thread a tile in SASS against 64, the same loads and stores (Triton 3.6; in the whole
input-gradient kernel 144 against 96).

Measured on an H100 at 780aa4a (Triton 3.6, ``lab/results/finetune_h100/xpose_words_780aa4a.txt``; the library
then had both forms, setting ``WORDS``): bit for bit the byte form's output (both GEMMs, with and without LoRA's
term); the input gradients gate_up 5.65 / 5.85 ms against 6.15 / 5.88, down 2.98 / 2.95 against 2.93 / 2.99; the
frozen MoE 17.28 / 17.47 ms against 17.82 / 17.79 (bf16 experts 21.39).

Here, on any machine: the three forms (bytes, words, and ``lab.probes.fp8_xpose_ldsm``'s matrix loads) built for
sm_90 in a kernel that transposes one tile, their shared-memory instructions counted in the PTX and their ``PRMT``
in the SASS.

    PYTHONPATH=. python -m lab.probes.fp8_xpose_words
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from csattn.ops.fp8.gluon import transpose_words
from csattn.ops.fp8.gluon_tiles import tile_smem
from lab.probes.fp8_xpose_ldsm import pairs_layout, sorted_pairs


@gluon.constexpr_function
def bytes_layout():
    """The byte form's register layout of a ``[128, 64]`` FP8 piece (the library's up to 780aa4a): a thread holds 16
    rows by 4 bytes, lane bit 0 moves 16 rows, the other lanes walk the 4-byte words, the warps 32 and 64 rows."""
    return gl.DistributedLinearLayout(reg_bases=[[1, 0], [2, 0], [0, 1], [0, 2], [4, 0], [8, 0]],
                                      lane_bases=[[16, 0], [0, 4], [0, 8], [0, 16], [0, 32]],
                                      warp_bases=[[32, 0], [64, 0]], block_bases=[], shape=[128, 64])


@gluon.jit
def xpose_kernel(src, dst, FORM: gl.constexpr):
    """One ``[128, 128]`` e4m3 tile from ``src`` (row-major) into shared memory, transposed there in ``FORM``
    (:data:`FORMS`), out to ``dst``."""
    BL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, 128, layout=gl.SliceLayout(1, BL))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, BL))
    at = gl.expand_dims(rows, 1) * 128 + gl.expand_dims(cols, 0)
    raw = gl.allocate_shared_memory(gl.float8e4nv, [128, 128], tile_smem())
    bt = gl.allocate_shared_memory(gl.float8e4nv, [128, 128], tile_smem())
    raw.store(gl.load(src + at))
    gl.thread_barrier() if hasattr(gl, "thread_barrier") else gl.barrier()
    if FORM == "ldsm":
        p16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        x = (raw.reinterpret if hasattr(raw, "reinterpret") else raw._reinterpret)(gl.int16, [128, 64], p16)
        bt16 = (bt.reinterpret if hasattr(bt, "reinterpret") else bt._reinterpret)(gl.int16, [128, 64], p16)
        bt16.store(sorted_pairs(x.load(pairs_layout())))
    else:
        for c in gl.static_range(2):
            if FORM == "words":
                transpose_words(raw, bt, c)
            else:
                piece = raw.slice(c * 64, 64, dim=1).load(bytes_layout())
                bt.slice(c * 64, 64, dim=0).store(gl.permute(piece, (1, 0)))
    gl.thread_barrier() if hasattr(gl, "thread_barrier") else gl.barrier()
    gl.store(dst + at, bt.load(BL))


def sass_counts(ptx: str) -> dict:
    """SASS opcode counts of the built PTX (ptxas, then cuobjdump)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(ptx)
        subprocess.run([ptxas, "-arch=sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"], check=True)
        sass = subprocess.run([cuobjdump, "-sass", f"{tmp}/k.cubin"],
                              capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass)
    return {op: sum(1 for o in ops if o.split(".")[0] == op) for op in ("PRMT", "LDS", "STS", "SHF", "LOP3", "IMAD")}


FORMS = ("bytes", "words", "ldsm")
PTX = {"ldmatrix_trans": r"ldmatrix\.sync\.aligned\.m8n8\.x\d\.trans", "stmatrix": r"stmatrix\.sync",
       "ld_shared_b32": r"ld\.shared\.b32", "ld_shared_v4": r"ld\.shared\.v4", "st_shared_v4": r"st\.shared\.v4",
       "st_shared_b32": r"st\.shared\.b32", "prmt_ptx": r"prmt\.b32", "shfl": r"shfl\.sync"}


def build(form: str) -> dict:
    from tests.ops.gluon_sm90 import build_sm90

    kernel, ptx, info = build_sm90(xpose_kernel, {"src": "*fp8e4nv", "dst": "*fp8e4nv"}, dict(FORM=form),
                                   ["src", "dst"])
    count = {name: len(re.findall(pat, ptx)) for name, pat in PTX.items()}
    return {"form": form, "ptxas_rc": info["ptxas_rc"], "spills": info["spill_stores"], **count,
            "sass": sass_counts(ptx)}


def main() -> None:
    for form in FORMS:
        try:
            print(json.dumps(build(form)), flush=True)
        except Exception as err:  # the lowering may refuse a layout
            print(json.dumps({"form": form, "error": f"{type(err).__name__}: {str(err)[-1500:]}"}), flush=True)


if __name__ == "__main__":
    main()
