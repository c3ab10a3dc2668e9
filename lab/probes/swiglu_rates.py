"""The frozen FP8 MoE's elementwise kernels at the slice's 16k shapes (256 experts top-6: 98304 routed rows, I 2048,
hidden 4096), each timed in a CUDA graph with its GB/s, and, given ``--old DIR`` (``csattn/ops/{fp8,moe}/triton.py``
of an earlier commit copied there), the earlier kernels beside them on the same inputs, outputs compared bit for bit.

    PYTHONPATH=. python -m lab.probes.swiglu_rates [--old lab/probes/_old]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from functools import partial
from pathlib import Path

import torch
import triton

from csattn.ops.fp8.naive import FP8_DTYPE

LIMIT = 10.0


def load_old(folder: Path) -> tuple[types.ModuleType, types.ModuleType]:
    """The earlier ``fp8/triton.py`` and ``moe/triton.py`` as modules of the package (their relative imports resolve),
    the moe one reading the earlier quantizer tile."""
    def load(name: str, path: Path, text: str) -> types.ModuleType:
        spec = importlib.util.spec_from_loader(name, loader=None)
        mod = importlib.util.module_from_spec(spec)
        mod.__file__ = str(path)  # triton.jit reads the source through inspect
        sys.modules[name] = mod
        exec(compile(text, str(path), "exec"), mod.__dict__)
        return mod

    fp8 = load("csattn.ops.fp8._old_triton", folder / "fp8_triton.py", (folder / "fp8_triton.py").read_text())
    moe_text = (folder / "moe_triton.py").read_text().replace("from ..fp8.triton import",
                                                             "from ..fp8._old_triton import")
    (folder / "moe_triton_old.py").write_text(moe_text)
    moe = load("csattn.ops.moe._old_triton", folder / "moe_triton_old.py", moe_text)
    return fp8, moe


def timed(name: str, call, nbytes: float) -> None:
    ms = triton.testing.do_bench_cudagraph(call, rep=60)
    print(f"{name:44s} {ms:7.3f} ms {nbytes / ms / 1e6:7.0f} GB/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, default=None, help="folder with fp8_triton.py and moe_triton.py to compare")
    ap.add_argument("--rows", type=int, default=98304)
    args = ap.parse_args()
    from csattn.ops.fp8 import triton as new_fp8
    from csattn.ops.moe import triton as new_moe

    dev, n, inter, hidden = torch.device("cuda"), args.rows, 2048, 4096
    gen = torch.Generator(dev).manual_seed(0)
    gu = (torch.randn(n, 2 * inter, device=dev, generator=gen) * 3).bfloat16()
    w = torch.rand(n, device=dev, generator=gen)
    dh = torch.randn(n, inter, device=dev, generator=gen).bfloat16()
    x = torch.randn(n // 6, hidden, device=dev, generator=gen).bfloat16()

    def rows(cols):
        return (torch.empty(n, cols, dtype=FP8_DTYPE, device=dev), torch.empty(n, cols // 128, device=dev))

    mods = {"new": (new_fp8, new_moe)}
    if args.old is not None:
        mods["old"] = load_old(args.old)
    outs = {}
    for tag, (fp8, moe) in mods.items():
        hq, dq = rows(inter), rows(2 * inter)
        fwd = partial(moe.swiglu_fwd_triton, gu, w, LIMIT, fp8_out=hq, keep_h=False)
        bwd = partial(moe.swiglu_bwd_triton, gu, w, dh, LIMIT, fp8_out=dq, keep_dgu=False, keep_h=False)
        quant = partial(fp8.quantize_1x128_triton, x)
        fwd()
        dw = bwd()[2]
        qx = quant()
        torch.cuda.synchronize()
        outs[tag] = (hq, dq, dw, qx)
        timed(f"{tag}: swiglu forward, h quantized", fwd, n * inter * (4 + 1) + n * 4)
        timed(f"{tag}: swiglu backward, dgu quantized", bwd, n * inter * (4 + 2 + 2) + n * 8)
        timed(f"{tag}: quantize_1x128 [{n // 6}, {hidden}]", quant, x.numel() * 3)
        timed(f"{tag}: swiglu backward, dgu and h kept (bf16)",
              partial(moe.swiglu_bwd_triton, gu, w, dh, LIMIT), n * inter * (4 + 2 + 4 + 2) + n * 8)
    if "old" in outs:
        new, old = outs["new"], outs["old"]
        same = [torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                            b.view(torch.uint8) if b.dtype == FP8_DTYPE else b)
                for a, b in [(new[0][0], old[0][0]), (new[0][1], old[0][1]), (new[1][0], old[1][0]),
                             (new[1][1], old[1][1]), (new[3][0], old[3][0]), (new[3][1], old[3][1])]]
        rel = ((new[2] - old[2]).abs().max() / old[2].abs().max()).item()
        print(f"bits equal (h q, h s, dgu q, dgu s, x q, x s): {same}; dw max rel diff {rel:.2e}")


if __name__ == "__main__":
    main()
