"""What the probes of the Gluon FP8 kernel's input-gradient forms (``SWAP``, ``INPLACE``) share: a lab switch that
makes the op's input-gradient kernel calls take a form, the MoE's two GEMMs (256 experts top-6, 16k tokens, D 4096,
I 2048) timed each way beside the forward and bf16 ``grouped_mm``, and the frozen-expert MoE forward + input gradient
timed under a form."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from unittest import mock

import torch
import triton
from torch import Tensor

import csattn.ops.fp8.gluon as fp8_gluon
from benchmarks.providers.fp8 import GROUPED, _moe_case, _quantized, _routed
from csattn.ops.fp8 import dequantize, quantize_1x128
from tests.helpers import rel_err


@contextmanager
def input_grad_form(settings: dict | None, fwd: bool = False) -> Iterator[None]:
    """Within: the op's input-gradient kernel calls (``fwd``: and its forward's) take ``settings`` over their launch
    settings (``None``: the defaults). A lab switch: the library reads ``launch_settings`` per call and has no
    argument for a form that is off by default."""
    if not settings:
        yield
        return
    launch = fp8_gluon.launch_settings

    def formed(trans: bool) -> dict:
        return {**launch(trans), **(settings if trans or fwd else {})}

    with mock.patch.object(fp8_gluon, "launch_settings", formed):
        yield


def moe_gemms(dev: torch.device) -> Iterator[tuple[str, Tensor, Tensor, Tensor, int, torch.Generator]]:
    """The MoE's two GEMMs at ``GROUPED``'s shapes (routing by top-6 of Gaussian logits), one at a time: ``(name,
    weight e4m3 [E, N, K], its scales, offs, rows M, generator)``."""
    ids, _, plan, e, _, gen = _routed(dict(GROUPED), dev)
    d, inter = GROUPED["hidden"], GROUPED["inter"]
    for name, n_w, k_w in (("gate_up", 2 * inter, d), ("down", d, inter)):
        yield (name, *_quantized((e, n_w, k_w), dev, gen), plan.offs, ids.numel(), gen)


def time_gemms(forms: dict[str, dict]) -> None:
    """Each of the MoE's two GEMMs: the forward, the input gradient by default and in each of ``forms`` (name ->
    settings), and bf16 ``grouped_mm``, timed; each form's fp32 output against the default's (relative error, and
    whether equal bit for bit), the default's against bf16."""
    dev = torch.device("cuda")
    mm = fp8_gluon.grouped_mm_gluon
    for name, q, s, offs, m, gen in moe_gemms(dev):
        e, n_w, k_w = q.shape
        dy = torch.randn(m, n_w, device=dev, generator=gen, dtype=torch.bfloat16)
        qa, sa = quantize_1x128(dy)
        qx, sx = quantize_1x128(torch.randn(m, k_w, device=dev, generator=gen, dtype=torch.bfloat16))
        wb = torch.stack([dequantize(q[i], s[i], torch.bfloat16) for i in range(e)])
        base = mm(qa, sa, q, s, offs, True, out_dtype=torch.float32)
        ref = torch.nn.functional.grouped_mm(dy, wb, offs=offs).float()
        print(f"{name:8s} default vs bf16 {rel_err(base, ref):.2e}", flush=True)
        for form, settings in forms.items():
            got = mm(qa, sa, q, s, offs, True, out_dtype=torch.float32, settings=settings)
            torch.cuda.synchronize()
            print(f"{name:8s} {form} vs default: {rel_err(got, base):.2e}, equal {torch.equal(got, base)}, finite "
                  f"{bool(torch.isfinite(got).all())}", flush=True)
        ways = {"fwd (reference)": partial(mm, qx, sx, q, s, offs, False),
                "input grad, default": partial(mm, qa, sa, q, s, offs, True),
                **{f"input grad, {form}": partial(mm, qa, sa, q, s, offs, True, settings=settings)
                   for form, settings in forms.items()},
                "input grad, bf16 grouped_mm": partial(torch.nn.functional.grouped_mm, dy, wb, offs=offs)}
        for way, call in ways.items():
            ms = triton.testing.do_bench(call, warmup=10, rep=60)
            print(f"{name:8s} {way:36s} {ms:7.3f} ms {2 * m * n_w * k_w / ms / 1e9:6.1f} TFLOP/s", flush=True)


def frozen_moe_ms(compute: str, settings: dict | None = None, fwd: bool = False) -> float:
    """The frozen-expert MoE (the benchmark's ``moe_frozen`` case) forward + input gradient, ms, with the input
    gradient (``fwd``: and the forward) in the form ``settings`` (``None``: the default)."""
    case = _moe_case(dict(GROUPED), torch.device("cuda"), torch.bfloat16, compute)
    out = case.forward()[0]
    dout = torch.randn_like(out)

    def step():
        return torch.autograd.grad(case.forward()[0], case.leaves, dout)

    with input_grad_form(settings, fwd):
        return triton.testing.do_bench(step, warmup=10, rep=60)


def compare_moe(forms: dict[str, dict], fwd: bool = False) -> None:
    """:func:`frozen_moe_ms` with bf16 experts, FP8 by default and FP8 in each of ``forms`` (``fwd``: the forward's
    kernel calls too)."""
    bf16 = frozen_moe_ms("bf16")
    print(f"frozen MoE fwd + input grad: bf16 experts {bf16:.2f} ms", flush=True)
    for form, settings in {"default": None, **forms}.items():
        ms = frozen_moe_ms("fp8", settings, fwd)
        print(f"frozen MoE fwd + input grad: FP8, {form}: {ms:.2f} ms ({bf16 / ms:.2f}x bf16)", flush=True)
