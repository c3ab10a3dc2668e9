"""The frozen-expert MoE with LoRA on the experts (rank 16; 256 experts top-6, 16k tokens, D 4096, I 2048; forward
+ backward: input, routing-weight and factor gradients), three ways side by side: bf16 experts, FP8 experts with
the LoRA term added after the kernel, and FP8 with the term in the Gluon kernel's epilogue
(``csattn.ops.fp8.gluon.FUSE_LOW_RANK``, set here for the run); the fused run's output and every gradient against
the unfused one's.
Run on an H200: python -m lab.probes.moe_lora_fused (``WAYS="bf16,fp8,fp8 fused"``: only those; bf16 and fp8 always
needed for the comparison)"""

import os
from unittest import mock

import torch

import csattn.ops.fp8.gluon as fp8_gluon
from benchmarks.providers.fp8 import GROUPED, LIMIT, _quantized, _routed
from csattn.ops.fp8 import dequantize
from csattn.ops.moe import ExpertLora, moe_experts
from tests.helpers import rel_err


def build(compute: str, rank: int = 16):
    dev = torch.device("cuda")
    shape = dict(GROUPED)
    ids, w, _, e, k, gen = _routed(shape, dev)
    d, inter, t = shape["hidden"], shape["inter"], shape["tokens"]
    gu, dn = _quantized((e, 2 * inter, d), dev, gen), _quantized((e, d, inter), dev, gen)
    x = torch.randn(t, d, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()
    w = w.bfloat16().requires_grad_()
    factors = [(torch.randn(s, device=dev, generator=gen) * 0.02).bfloat16().requires_grad_()
               for s in ((e, rank, d), (e, 2 * inter, rank), (e, rank, inter), (e, d, rank))]
    lora = dict(gate_up_lora=ExpertLora(factors[0], factors[1], 2.0), down_lora=ExpertLora(factors[2], factors[3], 2.0))
    if compute == "bf16":
        wgu = torch.stack([dequantize(gu[0][i], gu[1][i], torch.bfloat16) for i in range(e)])
        wdn = torch.stack([dequantize(dn[0][i], dn[1][i], torch.bfloat16) for i in range(e)])
        run = lambda: moe_experts(x, ids, w, wgu, wdn, LIMIT, "auto", **lora)  # noqa: E731
    else:
        run = lambda: moe_experts(x, ids, w, gu[0], dn[0], LIMIT, "auto", gate_up_scale=gu[1],  # noqa: E731
                                  down_scale=dn[1], fp8_compute="fp8", **lora)
    dout = torch.randn(t, d, device=dev, generator=gen, dtype=torch.bfloat16)
    return run, [x, w, *factors], dout


def step(run, leaves, dout):
    out = run()
    return [out, *torch.autograd.grad(out, leaves, dout)]


def timed(run, leaves, dout, reps: int = 10) -> float:
    for _ in range(3):
        step(run, leaves, dout)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        step(run, leaves, dout)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    results = {}
    for name, compute, fuse in (("bf16", "bf16", False), ("fp8", "fp8", False), ("fp8 fused", "fp8", True)):
        if name not in os.environ.get("WAYS", name).split(","):  # WAYS="bf16,fp8": only those
            continue
        # a lab switch for this comparison (the library reads it per call): the term in the kernel
        with mock.patch.object(fp8_gluon, "FUSE_LOW_RANK", fuse):
            run = leaves = dout = None  # the last way's weights go before this one's are made (an H100 ran out)
            run, leaves, dout = build(compute)
            results[name] = step(run, leaves, dout)
            print(f"{name:14s} {timed(run, leaves, dout):8.2f} ms  (fwd + bwd with LoRA rank 16 on the experts)")
    names = ["out", "dx", "dweights", "d gate_up a", "d gate_up b", "d down a", "d down b"]
    for i, n in enumerate(names):
        unfused, bf16 = results["fp8"][i], results["bf16"][i]
        others = "   ".join(f"{k} {rel_err(results[k][i], unfused):.2e}" for k in ("fp8 fused",) if k in results)
        print(f"  {n:12s} vs fp8 unfused: {others}   fp8 unfused vs bf16 {rel_err(unfused, bf16):.2e}")


if __name__ == "__main__":
    main()
