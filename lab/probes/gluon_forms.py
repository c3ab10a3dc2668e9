"""What the probes of the Gluon FP8 kernel share: a lab switch that makes the op's kernel calls take a form, the MoE's
two GEMMs (256 experts top-6, 16k tokens, D 4096, I 2048) and the forward's cases built on them, a timing in CUDA
graphs, the ring of stages of a forward kernel, the GEMMs timed each way beside the forward and bf16 ``grouped_mm``,
and the frozen-expert MoE forward + input gradient timed under a form."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from unittest import mock

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

import csattn.ops.fp8.gluon as fp8_gluon
from benchmarks.providers.fp8 import GROUPED, _moe_case, _quantized, _routed
from csattn.ops.fp8 import dequantize, quantize_1x128
from csattn.ops.fp8.gluon_tiles import BK, tile_smem
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


def forward_cases(dev: torch.device, gen: torch.Generator,
                  dense: tuple[tuple[int, int, int], ...]) -> list[tuple[str, Tensor, Tensor, Tensor, int]]:
    """The forward's cases: one group of ``m`` rows for each ``(m, n, k)`` of ``dense``, then the MoE's two GEMMs
    (:func:`moe_gemms`): ``(name, weight e4m3 [E, N, K], its scales, offs, rows M)``."""
    cases = [(f"{m}x{n}x{k}", *_quantized((1, n, k), dev, gen), torch.tensor([m], dtype=torch.int32, device=dev), m)
             for m, n, k in dense]
    return cases + [(name, q, s, offs, m) for name, q, s, offs, m, _ in moe_gemms(dev)]


def bench(name: str, way: str, call, flop: float) -> None:
    """Time ``call`` in a CUDA graph (the host's launch work left out: at 0.3 ms a dense call was host-bound, 188-787
    TFLOP/s from one run to the next) and print its ms and TFLOP/s (or why it failed)."""
    try:
        ms = triton.testing.do_bench_cudagraph(call, rep=60)
    except Exception as err:
        print(f"{name:16s} {way:44s} failed: {type(err).__name__}: {str(err)[:160]}", flush=True)
        return
    print(f"{name:16s} {way:44s} {ms:7.3f} ms {flop / ms / 1e9:7.1f} TFLOP/s", flush=True)


@gluon.jit
def forward_ring(STAGES: gl.constexpr, A_ROWS: gl.constexpr, B_ROWS: gl.constexpr):
    """A forward kernel's ring: ``STAGES`` stages of an e4m3 activation tile ``[A_ROWS, 128]`` and weight tile
    ``[B_ROWS, 128]``, each with its barriers: landed (the producer's expect) and free (both math warpgroups)."""
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, A_ROWS, BK], tile_smem())
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, B_ROWS, BK], tile_smem())
    land = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(land.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    return a_smem, b_smem, land, empty


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


def moe_step(compute: str, shape: dict | None = None):
    """One forward + input gradient of the frozen-expert MoE (the benchmark's ``moe_frozen`` case; ``shape``: another
    of ``GROUPED``'s form), a call: its gradients returned, none accumulated in the leaves."""
    case = _moe_case(dict(GROUPED) if shape is None else shape, torch.device("cuda"), torch.bfloat16, compute)
    dout = torch.randn_like(case.forward()[0])
    return lambda: torch.autograd.grad(case.forward()[0], case.leaves, dout)


def frozen_moe_ms(compute: str, settings: dict | None = None, fwd: bool = False, shape: dict | None = None) -> float:
    """:func:`moe_step` timed, ms, with the input gradient (``fwd``: and the forward) in the form ``settings``
    (``None``: the default)."""
    step = moe_step(compute, shape)
    with input_grad_form(settings, fwd):
        return triton.testing.do_bench(step, warmup=50, rep=400)  # ~20 calls: 3 had spread ~3 %


def compare_moe(forms: dict[str, dict], fwd: bool = False) -> None:
    """:func:`frozen_moe_ms` with bf16 experts, FP8 by default and FP8 in each of ``forms`` (``fwd``: the forward's
    kernel calls too)."""
    bf16 = frozen_moe_ms("bf16")
    print(f"frozen MoE fwd + input grad: bf16 experts {bf16:.2f} ms", flush=True)
    for form, settings in {"default": None, **forms}.items():
        ms = frozen_moe_ms("fp8", settings, fwd)
        print(f"frozen MoE fwd + input grad: FP8, {form}: {ms:.2f} ms ({bf16 / ms:.2f}x bf16)", flush=True)
