"""Providers for ``--op moe``: the routed experts of one MoE layer (no router, no shared expert) on ``tokens``
rows, ``routing=ExK`` (E experts, top-k), D ``hidden``, I ``inter``, clamped SwiGLU (limit 10).

- ``grouped``: :func:`csattn.ops.moe.moe_experts` with ``backend="auto"`` (grouped GEMMs, Triton SwiGLU and
  gather-sum on CUDA); variant ``grouped[torch]`` keeps the grouped GEMMs but runs the SwiGLU and gather-sum
  in PyTorch (``backend="grouped"``), to separate the kernels' share from the GEMMs';
- ``loop``: the per-expert reference loop (``backend="reference"``; reads the counts on the host).

Routing: top-k of Gaussian logits (about balanced), weights their softmax. FLOPs: forward ``6 N D I``
(``N = tokens * k``: the gate/up GEMM ``2 N D 2I`` and the down GEMM ``2 N I D``), backward twice that
(input and weight gradients of both GEMMs).

    python -m benchmarks.run --op moe --providers grouped,loop --mode fwd,bwd,fwdbwd \\
        --shape tokens=4096,16384,65536 --shape routing=8x2,64x6,256x6 --json moe.json
"""

from __future__ import annotations

import torch

from ..registry import Case, Skip, register

DEFAULTS = dict(tokens=4096, routing="8x2", hidden=4096, inter=2048, seed=0)
LIMIT = 10.0


def _routing(text) -> tuple[int, int]:
    experts, _, k = str(text).partition("x")
    try:
        return int(experts), int(k)
    except ValueError:
        raise Skip(f"routing must read ExK (e.g. 64x6), got {text!r}") from None


def _case(shape: dict, device, dtype, backend: str) -> Case:
    from csattn.ops.moe import moe_experts, resolve_backend

    e, k = _routing(shape["routing"])
    t, d, inter = shape["tokens"], shape["hidden"], shape["inter"]
    n = t * k
    es = torch.finfo(dtype).bits // 8
    # parameters and their gradients, plus the largest activations of either path (about six [N, max(D, 2I)])
    need = 2 * 3 * e * d * inter * es + 6 * n * max(d, 2 * inter) * es
    if device.type == "cuda" and need > 0.85 * torch.cuda.mem_get_info(device)[0]:
        raise Skip(f"needs about {need / 2**30:.0f} GiB")
    gen = torch.Generator(device=device).manual_seed(shape["seed"])
    x = torch.randn(t, d, device=device, generator=gen).to(dtype).requires_grad_()
    top = torch.topk(torch.randn(t, e, device=device, generator=gen), k, dim=-1)
    ids = top.indices
    w = torch.softmax(top.values, dim=-1).to(dtype).requires_grad_()
    gate_up = (torch.randn(e, 2 * inter, d, device=device, generator=gen) * d ** -0.5).to(dtype).requires_grad_()
    down = (torch.randn(e, d, inter, device=device, generator=gen) * inter ** -0.5).to(dtype).requires_grad_()
    path = resolve_backend(backend, x, gate_up, down)
    if backend != "reference" and path == "reference":
        raise Skip(f"grouped_mm does not take {dtype} at D {d}, I {inter}")
    fwd = 6 * n * d * inter
    return Case(forward=lambda: (moe_experts(x, ids, w, gate_up, down, LIMIT, backend=backend),),
                leaves=[x, w, gate_up, down], flops={"fwd": fwd, "bwd": 2 * fwd},
                info={"experts": e, "top_k": k, "path": path})


@register("moe", "grouped", DEFAULTS)
def grouped_moe(shape, device, dtype, variant=""):
    if variant not in ("", "torch"):
        raise Skip(f"unknown variant {variant!r} (only 'torch')")
    return _case(shape, device, dtype, "grouped" if variant == "torch" else "auto")


@register("moe", "loop", DEFAULTS)
def loop_moe(shape, device, dtype, variant=""):
    return _case(shape, device, dtype, "reference")
