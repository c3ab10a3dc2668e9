"""Providers for ``--op layer_step``: one whole training step of one attention layer (forward + backward with a
fixed output gradient) per call, eager vs CUDA graph replay. Run with ``--mode fwd`` (each "fwd" call is the
whole step; the other modes would add a second backward).

- ``eager``: the default path (``PackedSeqs``; host-side metadata, row chunks and top-k slabs);
- ``capture_safe``: the capture-safe path run eagerly (``CaptureSafePackedSeqs``, static bounds, custom ops);
- ``graph``: the capture-safe step captured once in a CUDA graph (:class:`csattn.capture_safe.CapturedLayerStep`)
  and replayed; the pack's ``cu_seqlens`` are copied into the graph's buffers on every call, so the time
  includes rebuilding the metadata on the device.

Shape options are the ``layer`` op's (V4-Flash geometry, ``tokens``, ``layer``, ``doc_len``) plus ``backend``.

Example:
    python -m benchmarks.run --op layer_step --mode fwd --shape tokens=4096,32768 --shape layer=csa
"""

from __future__ import annotations

import torch

from csattn.models.deepseek_v4.flops import layer_flops

from ..registry import Case, Skip, register
from .layer import DEFAULTS, attention_config, doc_lengths

STEP_DEFAULTS = {**DEFAULTS, "tokens": 4096, "backend": "triton"}


def _setup(shape, device, dtype):
    from csattn import HybridAttention, PackedSeqs

    if device.type != "cuda" and shape["backend"] == "triton":
        raise Skip("the Triton path is timed on CUDA only (use --shape backend=reference on the CPU)")
    torch.manual_seed(shape["seed"])
    layer = HybridAttention(attention_config(shape, shape["backend"])).to(device=device, dtype=dtype)
    lengths = doc_lengths(shape["tokens"], shape["doc_len"])
    packed = PackedSeqs.from_lengths(lengths, device=device)
    gen = torch.Generator(device=device).manual_seed(shape["seed"])
    x = torch.randn(shape["tokens"], shape["hidden"], device=device, dtype=dtype, generator=gen)
    dy = torch.randn(shape["tokens"], shape["hidden"], device=device, dtype=dtype, generator=gen)
    flops = layer_flops(layer.config, lengths)
    # a "fwd" call is the whole step
    step_flops = {"fwd": flops["fwd"] + flops["bwd"]}
    return layer, packed, lengths, x.requires_grad_(), dy, step_flops


def _eager_case(layer, make_packed, x, dy, flops, info) -> Case:
    def step():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        y = layer(x, packed=make_packed())
        y.backward(dy)
        return (y.detach(),)

    # leaves=[]: the step clears its own gradients (the runner's grad_to_none would break the graph's buffers)
    return Case(forward=step, leaves=[], flops=flops, info=info)


@register("layer_step", "eager", STEP_DEFAULTS)
def eager_step(shape, device, dtype, variant=""):
    layer, packed, lengths, x, dy, flops = _setup(shape, device, dtype)
    return _eager_case(layer, lambda: packed, x, dy, flops, {"docs": len(lengths), "path": "default"})


@register("layer_step", "capture_safe", STEP_DEFAULTS)
def capture_safe_step(shape, device, dtype, variant=""):
    from csattn.capture_safe import CaptureSafePackedSeqs

    layer, packed, lengths, x, dy, flops = _setup(shape, device, dtype)
    t, m = shape["tokens"], max(lengths)

    def make_packed():
        # built every step, as inside a captured graph: the metadata is recomputed from the device cu_seqlens
        return CaptureSafePackedSeqs(packed.cu_seqlens, packed.cu_seqlens_padded, num_rows=t, max_seqlen=m)

    return _eager_case(layer, make_packed, x, dy, flops, {"docs": len(lengths), "path": "capture_safe"})


@register("layer_step", "graph", STEP_DEFAULTS)
def graph_step(shape, device, dtype, variant=""):
    from csattn.capture_safe import CapturedLayerStep

    if device.type != "cuda":
        raise Skip("CUDA graphs need a CUDA device")
    layer, packed, lengths, x, dy, flops = _setup(shape, device, dtype)
    step = CapturedLayerStep(layer, x.detach(), dy, packed.cu_seqlens, packed.cu_seqlens_padded, max(lengths))

    def replay():
        return (step.replay(cu_seqlens=packed.cu_seqlens, cu_seqlens_padded=packed.cu_seqlens_padded),)

    return Case(forward=replay, leaves=[], flops=flops, info={"docs": len(lengths), "path": "cuda_graph"})
