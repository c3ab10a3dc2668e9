"""Where the Gluon FP8 kernel's forward stands against cuBLAS: settings of the kernel at the MoE's shapes (256 experts
top-6, 16k tokens, D 4096, I 2048), in both directions, and the same kernel on one dense group beside cuBLAS's
blockwise ``torch._scaled_mm`` (1x128 / 128x128 scales) and bf16 ``mm`` on that shape.

Why: the input gradient cannot beat bf16 on sm_90 (every form measured runs at its speed), so the frozen MoE's 1.3x
over bf16 could only come from the forward: 7.02 ms at 3e8515f (731 / 658 TFLOP/s) would have to fall to about 4.8
(about 1075 / 965), which is what cuBLAS's dense blockwise GEMM runs (1081-1167 at these widths). Each way's output
against the default's (the same products in the same order: equal bit for bit). Run on a GPU of sm_90:
python -m lab.probes.fp8_gluon_fwd"""

from __future__ import annotations

from functools import partial

import torch

from benchmarks.providers.fp8 import _quantized
from csattn.ops.fp8 import dequantize, quantize_1x128
from csattn.ops.fp8.gluon import grouped_mm_gluon
from lab.probes.gluon_forms import bench, compare_moe, moe_gemms

# Ways of running the kernel: (the activation's scales transposed, settings). At 9f38fc4 (H100) 5 / 6 stages and
# GROUP_M 4 / 16 were slower at the MoE's shapes. SIMPLE: one product in flight a math warpgroup, waited for before
# its promotion (DeepGEMM's SM90 loop): slower in the forward, faster in the input gradient, now its default
# (8648eae). "scales transposed": the layout DeepGEMM asks for (contiguous along a tile's rows), read by strides: at
# 0684271 (H100) slower in the forward (682 against 778 TFLOP/s at gate_up), faster in the input gradient (6.19
# against 6.32 ms, 3.17 against 3.40; at 9c9c651 6.30 against 6.40, 3.36 against 3.28). At 9c9c651 a math
# warpgroup passing a tile it has no rows in (PASS, 6.5 % of the MoE's MMAs; the same SASS in the loop) made the
# forward slower, gate_up 5.00 against 4.46 ms: the warpgroups out of step hold the ring's stages longer; removed.
# "direct stores": the result from the accumulator's layout, 4 bytes a thread (COALESCED off; the default up to
# d5940f4).
WAYS = {"default": (False, None), "scales transposed": (True, None), "SIMPLE": (False, dict(SIMPLE=True)),
        "STAGES 6": (False, dict(STAGES=6)), "direct stores": (False, dict(COALESCED=False))}
TRANS_WAYS = {"default": (False, None), "scales transposed": (True, None),
              "direct stores": (False, dict(COALESCED=False))}


def _compare(name: str, a: torch.Tensor, q: torch.Tensor, s: torch.Tensor, offs: torch.Tensor, trans: bool,
             ways: dict) -> None:
    """``a`` (bf16) quantized once, its scales in both layouts; each way's fp32 output against the first way's,
    then its time."""
    qa, sa_t = quantize_1x128(a, scale_t=True)
    scales = {False: sa_t.contiguous(), True: sa_t}
    flop = 2.0 * a.shape[0] * q.shape[1] * q.shape[2]
    base = None
    for way, (transposed, settings) in ways.items():
        label = f"{'input grad ' if trans else ''}{way}"
        call = partial(grouped_mm_gluon, qa, scales[transposed], q, s, offs, trans, settings=settings)
        try:
            got = call(out_dtype=torch.float32)
            torch.cuda.synchronize()
        except Exception as err:
            print(f"{name:16s} {label:44s} failed: {type(err).__name__}: {str(err)[:160]}", flush=True)
            continue
        base = got if base is None else base
        print(f"{name:16s} {label:44s} equal to the default {torch.equal(got, base)}", flush=True)
        bench(name, label, call, flop)


def grouped() -> None:
    """The MoE's two GEMMs, forward and input gradient, by way."""
    dev = torch.device("cuda")
    for name, q, s, offs, m, gen in moe_gemms(dev):
        _, n_w, k_w = q.shape
        _compare(name, torch.randn(m, k_w, device=dev, generator=gen, dtype=torch.bfloat16), q, s, offs, False, WAYS)
        _compare(name, torch.randn(m, n_w, device=dev, generator=gen, dtype=torch.bfloat16), q, s, offs, True,
                 TRANS_WAYS)


def dense() -> None:
    """One group of 16384 rows: the Gluon kernel by way, cuBLAS blockwise FP8, bf16 ``mm``."""
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    for m, n, k in ((16384, 4096, 2048), (16384, 2048, 4096)):
        q, s = _quantized((1, n, k), dev, gen)
        x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
        name = f"{m}x{n}x{k}"
        _compare(name, x, q, s, torch.tensor([m], dtype=torch.int32, device=dev), False, WAYS)
        qt, st = quantize_1x128(x, scale_t=True)
        flop = 2.0 * m * n * k
        bench(name, "cuBLAS _scaled_mm", partial(torch._scaled_mm, qt, q[0].t(), scale_a=st, scale_b=s[0].t(),
                                                  out_dtype=torch.bfloat16), flop)
        bench(name, "bf16 mm", partial(torch.mm, x, dequantize(q[0], s[0], torch.bfloat16).t()), flop)


if __name__ == "__main__":
    grouped()
    dense()
    for _ in range(2):  # the frozen MoE's forward + input gradient, the result stored directly in both directions
        compare_moe({"direct stores": dict(COALESCED=False)}, fwd=True)
