"""Providers for ``--op mhc``: one mHC site of a DeepSeek-V4 block on ``tokens`` rows, ``hc`` streams of
``hidden`` channels (stream dtype from ``--dtype``, bf16 by default; the mHC parameters fp32 as in the model).

``part`` picks what is timed:

- ``site`` (default): the pre-mapping (weights, Sinkhorn, collapse), then the combine of the collapsed row
  back into the streams (it stands in for the block output), so every gradient path runs;
- ``pre``: the pre-mapping alone (output: the collapsed rows); ``head``: the final collapse (HyperHead);
- ``combine``: ``post * y + comb^T X`` alone.

Providers: ``triton`` (the fused kernels; variant ``triton[fwd_rows=64,bwd_k=64,...]``: the
``csattn.ops.mhc.MhcConfig`` they run with) and ``reference`` (plain PyTorch autograd). The op is memory-bound:
``info["bytes"]`` holds the compulsory traffic per mode (each stream-sized tensor read or written once),
and the runner reports GB/s against it.

    python -m benchmarks.run --op mhc --providers triton,reference --mode fwd,bwd,fwdbwd \\
        --shape tokens=4096,16384,65536 --json mhc.json
"""

from __future__ import annotations

import torch

from ..registry import Case, Skip, register

DEFAULTS = dict(tokens=16384, hidden=4096, hc=4, iters=20, part="site", seed=0)
EPS = 1e-6


def _config(variant: str):
    from csattn.ops.mhc import MhcConfig

    try:
        return MhcConfig.parse(variant)
    except ValueError as e:
        raise Skip(str(e)) from None


def _bytes(part: str, t: int, n: int, d: int, es: int) -> dict[str, float]:
    k = n * d
    pre = {"fwd": t * (k + d) * es, "bwd": t * (2 * k + d) * es}
    comb = {"fwd": t * (2 * k + d) * es, "bwd": t * (3 * k + 2 * d) * es}
    if part == "site":
        return {m: pre[m] + comb[m] for m in pre}
    return comb if part == "combine" else pre


def _case(shape: dict, device, dtype, backend: str, variant: str) -> Case:
    from csattn.ops.backend import interpreting
    from csattn.ops.mhc import hc_combine, hc_head, hc_pre

    config = None
    if backend == "triton":
        if device.type != "cuda" and not interpreting():
            raise Skip("the Triton path is timed on CUDA only (TRITON_INTERPRET=1 runs it on the CPU, slowly)")
        config = _config(variant)
    elif variant:
        raise Skip(f"the reference takes no variant, got {variant!r}")
    t, d, n, iters, part = shape["tokens"], shape["hidden"], shape["hc"], shape["iters"], shape["part"]
    if part not in ("site", "pre", "head", "combine"):
        raise Skip(f"part must be site, pre, head or combine, got {part!r}")
    es = torch.finfo(dtype).bits // 8
    k = n * d
    # the streams, their gradient and the combine's output and gradient, plus the reference's fp32 copies
    need = t * k * (4 * es + (24 if backend == "reference" else 0))
    if device.type == "cuda" and need > 0.85 * torch.cuda.mem_get_info(device)[0]:
        raise Skip(f"needs about {need / 2**30:.0f} GiB")
    gen = torch.Generator(device=device).manual_seed(shape["seed"])
    x = torch.randn(t, n, d, device=device, generator=gen).to(dtype).requires_grad_()
    width = n if part == "head" else (2 + n) * n
    fn = (0.02 * torch.randn(width, k, device=device, generator=gen)).requires_grad_()
    base = (0.5 * torch.randn(width, device=device, generator=gen)).requires_grad_()
    scale = (1 + 0.3 * torch.randn(1 if part == "head" else 3, device=device, generator=gen)).requires_grad_()
    info = {"bytes": _bytes(part, t, n, d, es), "part": part}

    def pre():
        return hc_pre(x, fn, base, scale, sinkhorn_iters=iters, hc_eps=EPS, norm_eps=EPS, backend=backend,
                      config=config)

    if part == "head":
        return Case(forward=lambda: (hc_head(x, fn, base, scale, hc_eps=EPS, norm_eps=EPS, backend=backend,
                                             config=config),),
                    leaves=[x, fn, base, scale], flops={}, info=info)
    if part == "pre":
        return Case(forward=lambda: (pre()[2],), leaves=[x, fn, base, scale], flops={}, info=info)
    if part == "combine":
        with torch.no_grad():
            post, comb, y = (o.detach() for o in pre())
        y.requires_grad_(), post.requires_grad_(), comb.requires_grad_()
        return Case(forward=lambda: (hc_combine(x, y, post, comb, backend=backend, config=config),),
                    leaves=[x, y, post, comb], flops={}, info=info)

    def site():
        post, comb, collapsed = pre()
        return (hc_combine(x, collapsed, post, comb, backend=backend, config=config),)

    return Case(forward=site, leaves=[x, fn, base, scale], flops={}, info=info)


@register("mhc", "triton", DEFAULTS)
def mhc_triton(shape, device, dtype, variant=""):
    return _case(shape, device, dtype, "triton", variant)


@register("mhc", "reference", DEFAULTS)
def mhc_reference(shape, device, dtype, variant=""):
    return _case(shape, device, dtype, "reference", variant)
