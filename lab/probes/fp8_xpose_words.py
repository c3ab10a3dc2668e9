"""The input gradient's weight-tile transposition with the byte permutes written out: the copied ``[128 K, 128 N]``
e4m3 tile read as 4-byte words (a thread: 16 K rows of one word, as ``gluon.transpose_layout`` reads it), each
4 x 4 block of bytes (4 K rows by the word's 4 N) transposed by 8 ``prmt`` (two rounds of 4: pairs of rows
interleaved, then pairs of pairs), and the words written K-major, 4 consecutive words (16 bytes) a store. Today's
transposer lets the lowering sort the bytes of ``gl.permute``; in SASS that takes 96 ``PRMT`` a thread a tile
(``lab.probes.fp8_xpose_ldsm``), against 64 here.

Here, on any machine: both forms built for sm_90 in a kernel that transposes one tile, their shared-memory
instructions counted in the PTX and their ``PRMT`` in the SASS.

    PYTHONPATH=. python -m lab.probes.fp8_xpose_words [--measure: on sm_90, bit for bit and timed against the
    lowering's form, alone and in the frozen MoE]
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from csattn.ops.fp8.gluon import transpose_layout, transpose_words
from csattn.ops.fp8.gluon_tiles import tile_smem


@gluon.jit
def xpose_kernel(src, dst, WORDS: gl.constexpr):
    """One ``[128, 128]`` e4m3 tile from ``src`` (row-major) into shared memory, transposed there, out to ``dst``."""
    BL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, 128, layout=gl.SliceLayout(1, BL))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, BL))
    at = gl.expand_dims(rows, 1) * 128 + gl.expand_dims(cols, 0)
    raw = gl.allocate_shared_memory(gl.float8e4nv, [128, 128], tile_smem())
    bt = gl.allocate_shared_memory(gl.float8e4nv, [128, 128], tile_smem())
    raw.store(gl.load(src + at))
    gl.thread_barrier() if hasattr(gl, "thread_barrier") else gl.barrier()
    for c in gl.static_range(2):
        if WORDS:
            transpose_words(raw, bt, c)
        else:
            piece = raw.slice(c * 64, 64, dim=1).load(transpose_layout())
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


def build(words: bool) -> dict:
    from tests.ops.gluon_sm90 import build_sm90

    kernel, ptx, info = build_sm90(xpose_kernel, {"src": "*fp8e4nv", "dst": "*fp8e4nv"}, dict(WORDS=words),
                                   ["src", "dst"])
    count = {name: len(re.findall(pat, ptx)) for name, pat in {
        "ld_shared_b32": r"ld\.shared\.b32", "ld_shared_v4": r"ld\.shared\.v4", "st_shared_v4": r"st\.shared\.v4",
        "st_shared_b32": r"st\.shared\.b32", "prmt_ptx": r"prmt\.b32", "shfl": r"shfl\.sync"}.items()}
    return {"words": words, "ptxas_rc": info["ptxas_rc"], "spills": info["spill_stores"], **count,
            "sass": sass_counts(ptx)}


def measure() -> None:
    """On sm_90: the library's input gradient with the written-out permutes (``WORDS``) against the lowering's, bit for
    bit (with and without LoRA's term) and timed at the slice's 16k tokens (CUDA graphs), then the frozen MoE each
    way, alternating."""
    from functools import partial

    import torch

    from csattn.ops.fp8 import quantize_1x128
    from csattn.ops.fp8.gluon import RANK, grouped_mm_gluon
    from lab.probes.gluon_forms import bench, frozen_moe_ms, moe_gemms

    dev = torch.device("cuda")
    print(f"== {torch.cuda.get_device_name()}", flush=True)
    forms = {"words": {"WORDS": True}, "bytes": {"WORDS": False}}
    for name, q, s, offs, m, gen in moe_gemms(dev):
        qa, sa = quantize_1x128(torch.randn(m, q.shape[1], device=dev, generator=gen, dtype=torch.bfloat16))
        lr = (torch.randn(m, RANK, generator=gen, device=dev).bfloat16(),
              (torch.randn(q.shape[0], q.shape[2], RANK, generator=gen, device=dev) * 0.3).bfloat16(), 0.75)
        for term in (None, lr):
            got = [grouped_mm_gluon(qa, sa, q, s, offs, True, low_rank=term, settings=f) for f in forms.values()]
            torch.cuda.synchronize()
            print(f"{name:8s} words equal to bytes ({'with' if term else 'without'} LoRA's term): "
                  f"{torch.equal(*got)}", flush=True)
        flop = 2.0 * m * q.shape[1] * q.shape[2]
        for _ in range(2):
            for way, f in forms.items():
                bench(name, f"input gradient, {way}", partial(grouped_mm_gluon, qa, sa, q, s, offs, True, settings=f),
                      flop)
    bf16 = frozen_moe_ms("bf16")
    for _ in range(2):
        ms = {way: frozen_moe_ms("fp8", f) for way, f in forms.items()}
        print(f"frozen MoE (bf16 experts {bf16:.2f} ms): " + ", ".join(
            f"{way} {v:.2f} ({bf16 / v:.3f}x)" for way, v in ms.items()), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        measure()
        return
    for words in (False, True):
        try:
            print(json.dumps(build(words)), flush=True)
        except Exception as err:  # the lowering may refuse a layout
            print(json.dumps({"words": words, "error": f"{type(err).__name__}: {str(err)[-1500:]}"}), flush=True)


if __name__ == "__main__":
    main()
