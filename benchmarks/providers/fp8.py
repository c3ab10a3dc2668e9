"""Providers for the FP8 ops (frozen e4m3 weights with 128x128 block scales; csattn.ops.fp8). Random weights
drawn in bf16 and quantized per block; activations and gradients bf16.

- ``--op fp8_quant`` (``rows`` x ``cols``): ``triton`` (the fused 1x128 quantizer), ``reference`` (PyTorch);
  GB/s over the bytes one call must move (read bf16 x, write e4m3 q and the fp32 scales).
- ``--op fp8_linear`` (``rows`` x ``inter`` <- ``hidden``, i.e. ``M x N <- K``): ``fp8``, ``w8a16`` (fp8_linear),
  ``bf16`` (F.linear on the dequantized bf16 weight, frozen); ``bwd`` is the input gradient alone.
  ``dgrad[METHOD]`` times the input gradient alone by one route of ``csattn.ops.fp8.linear.input_grad``:
  ``copy``, ``bf16``, ``triton`` (FP8), ``triton_w8a16``.
- ``--op fp8_grouped`` (``tokens``, ``routing=ExK``, ``hidden`` D, ``inter`` I, ``gemm``): one grouped GEMM
  over ``N = tokens * k`` expert-sorted rows: ``gemm=gate_up`` (``[N, D] x W^T``, W ``[E, 2I, D]``),
  ``down`` (``[N, I] x W^T``, W ``[E, D, I]``), ``gate_up_t`` / ``down_t`` (their input gradients, ``x W``).
  Providers ``fp8``, ``w8a16`` (fp8_grouped_mm), ``fp8[triton]`` (the Triton kernels: FP8 forward, W8A16 input
  gradient) and ``bf16`` (torch grouped_mm on the bf16 weights).
- ``--op moe_frozen`` (as ``--op moe``): the routed experts with frozen weights, forward and input gradient (x and
  the routing weights; no weight gradient): ``fp8``, ``w8a16`` (FP8 experts), ``bf16`` (bf16 experts).

FLOPs: ``2 M N K`` per GEMM; the frozen MoE ``6 N D I`` forward and the same backward.

    python -m benchmarks.run --op fp8_grouped --providers fp8,w8a16,bf16 --mode fwd \\
        --shape routing=8x2,256x6 --shape gemm=gate_up,down,gate_up_t,down_t --shape tokens=16384
"""

from __future__ import annotations

import torch

from ..registry import Case, Skip, register
from .moe import LIMIT, _routing

LINEAR = dict(rows=16384, hidden=4096, inter=2048, seed=0)
GROUPED = dict(tokens=16384, routing="256x6", hidden=4096, inter=2048, gemm="gate_up", seed=0)
QUANT = dict(rows=16384, cols=4096, seed=0)


def _quantized(shape: tuple[int, ...], device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """A random bf16 weight (fan-in scaled) quantized to e4m3 per 128x128 block with fp32 scales (what a release
    holds), one matrix at a time: fp32 copies of all 256 experts at once would take 16 GiB."""
    from csattn.models.deepseek_v4.release import quantize_fp8_blocks

    *lead, n, k = shape
    w = torch.randn(*shape, device=device, generator=gen, dtype=torch.bfloat16) * k ** -0.5
    q = torch.empty(shape, device=device, dtype=torch.float8_e4m3fn).view(-1, n, k)
    s = torch.empty(q.shape[0], n // 128, k // 128, device=device)
    for i, matrix in enumerate(w.view(-1, n, k)):
        q[i], s[i] = quantize_fp8_blocks(matrix, scale_kind="fp32")
    return q.view(shape), s.view(*lead, n // 128, k // 128)


def _need_cuda(device) -> None:
    if device.type != "cuda":
        raise Skip("the FP8 kernels need CUDA")


def _register_each(op: str, defaults: dict, build, names: tuple[str, ...]) -> None:
    """Register ``build(shape, device, dtype, name)`` as provider ``name`` of ``op`` for each name (no variants)."""
    for name in names:
        def provider(shape, device, dtype, variant="", _name=name):
            return build(shape, device, dtype, _name)

        register(op, name, defaults)(provider)


def _quant_case(shape, device, dtype, which):
    from csattn.ops.fp8 import quantize_1x128, quantize_1x128_ref

    m, k = shape["rows"], shape["cols"]
    x = torch.randn(m, k, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(shape["seed"]))
    fn = quantize_1x128 if which == "triton" else quantize_1x128_ref
    moved = m * k * (x.element_size() + 1) + m * (k // 128) * 4
    return Case(forward=lambda: fn(x), leaves=[], flops={}, info={"bytes": {"fwd": moved}})


_register_each("fp8_quant", QUANT, _quant_case, ("triton", "reference"))


def _linear_operands(shape, device):
    gen = torch.Generator(device).manual_seed(shape["seed"])
    m, n, k = shape["rows"], shape["inter"], shape["hidden"]
    q, s = _quantized((n, k), device, gen)
    x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16).requires_grad_()
    return x, q, s, 2 * m * n * k


def _linear_case(shape, device, dtype, compute):
    from csattn.ops.fp8 import dequantize, fp8_linear

    _need_cuda(device)
    x, q, s, flops = _linear_operands(shape, device)
    if compute == "bf16":
        w = dequantize(q, s, torch.bfloat16)
        fwd = lambda: (torch.nn.functional.linear(x, w),)  # noqa: E731
    else:
        fwd = lambda: (fp8_linear(x, q, s, compute),)  # noqa: E731
    return Case(forward=fwd, leaves=[x], flops={"fwd": flops, "bwd": flops}, info={"compute": compute})


_register_each("fp8_linear", LINEAR, _linear_case, ("fp8", "w8a16", "bf16"))


@register("fp8_linear", "dgrad", LINEAR)
def linear_dgrad(shape, device, dtype, variant=""):
    from csattn.ops.fp8.linear import DGRADS, input_grad

    _need_cuda(device)
    method, _, mode = (variant or "copy").partition("_")
    if method not in DGRADS:
        raise Skip(f"variant must be one of {DGRADS} (triton_w8a16 for the W8A16 kernel), got {variant!r}")
    x, q, s, flops = _linear_operands(shape, device)
    dy = torch.randn(shape["rows"], shape["inter"], device=device, dtype=torch.bfloat16)
    return Case(forward=lambda: (input_grad(dy, q, s, mode or "fp8", method),), leaves=[], flops={"fwd": flops},
                info={"method": method, "mode": mode or "fp8"})


def _routed(shape, device):
    """Routing of ``tokens`` by top-k of Gaussian logits: (ids [T, k], weights [T, k], offs [E] int32, order)."""
    from csattn.ops.moe import route_plan

    e, k = _routing(shape["routing"])
    gen = torch.Generator(device).manual_seed(shape["seed"])
    top = torch.topk(torch.randn(shape["tokens"], e, device=device, generator=gen), k, dim=-1)
    return top.indices, torch.softmax(top.values, -1), route_plan(top.indices, e), e, k, gen


@register("fp8_grouped", "fp8", GROUPED)
def grouped_fp8(shape, device, dtype, variant=""):
    """``fp8[triton]``: the Triton kernels on any GPU (FP8 forward, W8A16 input gradient), what sm_90 ran before
    the Gluon kernel."""
    if variant not in ("", "triton"):
        raise Skip(f"variant must be triton or none, got {variant!r}")
    return _grouped_case(shape, device, dtype, "fp8_triton" if variant else "fp8")


def _grouped_case(shape, device, dtype, compute):
    from csattn.ops.fp8 import dequantize, fp8_grouped_mm
    from csattn.ops.moe.grouped import _grouped_mm

    _need_cuda(device)
    _, _, plan, e, k, gen = _routed(shape, device)
    d, inter, gemm = shape["hidden"], shape["inter"], shape["gemm"]
    if gemm not in ("gate_up", "down", "gate_up_t", "down_t"):
        raise Skip(f"gemm must be gate_up, down, gate_up_t or down_t, got {gemm!r}")
    wshape = (e, 2 * inter, d) if gemm.startswith("gate_up") else (e, d, inter)
    trans = gemm.endswith("_t")
    q, s = _quantized(wshape, device, gen)
    n = shape["tokens"] * k
    a = torch.randn(n, wshape[1] if trans else wshape[2], device=device, generator=gen, dtype=torch.bfloat16)
    flops = 2 * n * wshape[1] * wshape[2]
    if compute == "bf16":
        w = torch.stack([dequantize(q[i], s[i], torch.bfloat16) for i in range(e)])
        del q, s
        b = w if trans else w.transpose(-2, -1)
        fwd = lambda: (_grouped_mm(a, b, offs=plan.offs),)  # noqa: E731
    elif compute == "fp8_triton":
        fwd = lambda: (_triton_route(a, q, s, plan.offs, trans),)  # noqa: E731
    else:
        fwd = lambda: (fp8_grouped_mm(a, q, s, plan.offs, trans=trans, compute=compute),)  # noqa: E731
    return Case(forward=fwd, leaves=[], flops={"fwd": flops}, info={"experts": e, "top_k": k, "rows": n})


_register_each("fp8_grouped", GROUPED, _grouped_case, ("w8a16", "bf16"))


def _triton_route(a, q, s, offs, trans):
    from csattn.ops.fp8.triton import grouped_mm_triton, quantize_1x128_triton

    if trans:
        return grouped_mm_triton(a, None, q, s, offs, True, out_dtype=a.dtype)
    qa, sa = quantize_1x128_triton(a)
    return grouped_mm_triton(qa, sa, q, s, offs, False, out_dtype=a.dtype)


def _moe_case(shape, device, dtype, compute):
    from csattn.ops.fp8 import dequantize
    from csattn.ops.moe import moe_experts

    _need_cuda(device)
    ids, w, _, e, k, gen = _routed(shape, device)
    d, inter, t = shape["hidden"], shape["inter"], shape["tokens"]
    gu, dn = _quantized((e, 2 * inter, d), device, gen), _quantized((e, d, inter), device, gen)
    x = torch.randn(t, d, device=device, generator=gen, dtype=torch.bfloat16).requires_grad_()
    w = w.bfloat16().requires_grad_()
    if compute == "bf16":
        wgu = torch.stack([dequantize(gu[0][i], gu[1][i], torch.bfloat16) for i in range(e)])
        wdn = torch.stack([dequantize(dn[0][i], dn[1][i], torch.bfloat16) for i in range(e)])
        fwd = lambda: (moe_experts(x, ids, w, wgu, wdn, LIMIT),)  # noqa: E731
    else:
        fwd = lambda: (moe_experts(x, ids, w, gu[0], dn[0], LIMIT, gate_up_scale=gu[1], down_scale=dn[1],  # noqa: E731
                                   fp8_compute=compute),)
    flops = 6 * t * k * d * inter
    return Case(forward=fwd, leaves=[x, w], flops={"fwd": flops, "bwd": flops},
                info={"experts": e, "top_k": k, "compute": compute})


_register_each("moe_frozen", GROUPED, _moe_case, ("fp8", "w8a16", "bf16"))
