"""Where the Gluon FP8 kernel's forward stands against cuBLAS: its stage count and tile order (``STAGES``,
``GROUP_M``) at the MoE's shapes (256 experts top-6, 16k tokens, D 4096, I 2048), and the same kernel on one dense
group beside cuBLAS's blockwise ``torch._scaled_mm`` (1x128 / 128x128 scales) and bf16 ``mm`` on that shape.

Why: the input gradient cannot beat bf16 on sm_90 (every form measured runs at its speed), so the frozen MoE's 1.3x
over bf16 could only come from the forward: 7.02 ms at 3e8515f (731 / 658 TFLOP/s) would have to fall to about 4.8
(about 1075 / 965), which is what cuBLAS's dense blockwise GEMM runs (1081-1167 at these widths). Each variant's
output against the default's (the same products in the same order: equal bit for bit). Run on a GPU of sm_90:
python -m lab.probes.fp8_gluon_fwd"""

from __future__ import annotations

from functools import partial

import torch
import triton

import csattn.ops.fp8.gluon as fp8_gluon
from benchmarks.providers.fp8 import GROUPED, _quantized, _routed
from csattn.ops.fp8 import quantize_1x128

# at 9f38fc4 (H100) 5 / 6 stages and GROUP_M 4 / 16 were slower at the MoE's shapes; SIMPLE: one product in flight
# a math warpgroup, waited for before its promotion (DeepGEMM's SM90 loop), against two: slower in the forward,
# faster in the input gradient (8648eae). "scales transposed": the activation's scales in the layout DeepGEMM asks
# for (contiguous along the rows), which the kernel reads by strides
VARIANTS = {"SIMPLE": dict(SIMPLE=True), "SIMPLE, STAGES 6": dict(SIMPLE=True, STAGES=6), "STAGES 6": dict(STAGES=6)}
TRANS_VARIANTS = {"SIMPLE": dict(SIMPLE=True)}


def _bench(name: str, way: str, call, flop: float) -> None:
    """Time ``call`` and print its ms and TFLOP/s (or why it failed)."""
    try:
        ms = triton.testing.do_bench(call, warmup=10, rep=60)
    except Exception as err:  # a variant that does not build or launch: say so, go on
        print(f"{name:8s} {way:28s} failed: {type(err).__name__}: {str(err)[:120]}", flush=True)
        return
    print(f"{name:8s} {way:28s} {ms:7.3f} ms {flop / ms / 1e9:7.1f} TFLOP/s", flush=True)


def grouped() -> None:
    """The MoE's two forward GEMMs by variant."""
    dev = torch.device("cuda")
    ids, _, plan, e, _, gen = _routed(dict(GROUPED), dev)
    m, d, inter = ids.numel(), GROUPED["hidden"], GROUPED["inter"]
    mm = fp8_gluon.grouped_mm_gluon
    for name, n_w, k_w in (("gate_up", 2 * inter, d), ("down", d, inter)):
        q, s = _quantized((e, n_w, k_w), dev, gen)
        x = torch.randn(m, k_w, device=dev, generator=gen, dtype=torch.bfloat16)
        qx, sx = quantize_1x128(x)
        sx_t = quantize_1x128(x, scale_t=True)[1]  # the scales' transposed layout: contiguous along a tile's rows
        base = mm(qx, sx, q, s, plan.offs, False, out_dtype=torch.float32)
        got = mm(qx, sx_t, q, s, plan.offs, False, out_dtype=torch.float32)
        print(f"{name:8s} scales transposed          equal to default {torch.equal(got, base)}", flush=True)
        _bench(name, "scales transposed", partial(mm, qx, sx_t, q, s, plan.offs, False), 2.0 * m * n_w * k_w)
        for way, settings in {"default": None, **VARIANTS}.items():
            try:
                got = mm(qx, sx, q, s, plan.offs, False, out_dtype=torch.float32, settings=settings)
                torch.cuda.synchronize()
            except Exception as err:  # a variant that does not build or launch: say so, go on
                print(f"{name:8s} {way:28s} failed: {type(err).__name__}: {str(err)[:120]}", flush=True)
                continue
            print(f"{name:8s} {way:28s} equal to default {torch.equal(got, base)}", flush=True)
            _bench(name, way, partial(mm, qx, sx, q, s, plan.offs, False, settings=settings), 2.0 * m * n_w * k_w)
        dy = torch.randn(m, n_w, device=dev, generator=gen, dtype=torch.bfloat16)
        qa, sa = quantize_1x128(dy)
        sa_t = quantize_1x128(dy, scale_t=True)[1]
        base = mm(qa, sa, q, s, plan.offs, True, out_dtype=torch.float32)
        got = mm(qa, sa_t, q, s, plan.offs, True, out_dtype=torch.float32)
        print(f"{name:8s} input grad scales transposed equal to default {torch.equal(got, base)}", flush=True)
        _bench(name, "input grad scales transposed", partial(mm, qa, sa_t, q, s, plan.offs, True), 2.0 * m * n_w * k_w)
        for way, settings in {"default": None, **TRANS_VARIANTS}.items():
            got = mm(qa, sa, q, s, plan.offs, True, out_dtype=torch.float32, settings=settings)
            print(f"{name:8s} input grad {way:17s} equal to default {torch.equal(got, base)}", flush=True)
            _bench(name, f"input grad {way}", partial(mm, qa, sa, q, s, plan.offs, True, settings=settings),
                   2.0 * m * n_w * k_w)
        del q, s


def dense() -> None:
    """One group of 16384 rows: the Gluon kernel, cuBLAS blockwise FP8, bf16 ``mm``."""
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    for name, (m, n, k) in (("dense", (16384, 4096, 2048)), ("dense", (16384, 2048, 4096))):
        q, s = _quantized((1, n, k), dev, gen)
        x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
        qx, sx = quantize_1x128(x)
        qt, st = quantize_1x128(x, scale_t=True)
        offs = torch.tensor([m], dtype=torch.int32, device=dev)
        wb = (q[0].float() * s[0].repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.bfloat16)
        flop = 2.0 * m * n * k
        tag = f"{m}x{n}x{k}"
        _bench(name, f"{tag} gluon", partial(fp8_gluon.grouped_mm_gluon, qx, sx, q, s, offs, False), flop)
        _bench(name, f"{tag} gluon scales transposed", partial(fp8_gluon.grouped_mm_gluon, qt, st, q, s, offs, False),
               flop)
        for way, settings in VARIANTS.items():
            _bench(name, f"{tag} gluon {way}", partial(fp8_gluon.grouped_mm_gluon, qx, sx, q, s, offs, False,
                                                       settings=settings), flop)
        _bench(name, f"{tag} cuBLAS _scaled_mm", partial(torch._scaled_mm, qt, q[0].t(), scale_a=st,
                                                         scale_b=s[0].t(), out_dtype=torch.bfloat16), flop)
        _bench(name, f"{tag} bf16 mm", partial(torch.mm, x, wb.t()), flop)


if __name__ == "__main__":
    grouped()
    dense()
