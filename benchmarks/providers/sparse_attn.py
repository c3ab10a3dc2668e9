"""Providers for ``--op sparse_attn``: the fused Triton kernels and the PyTorch reference on the same inputs.

Inputs look like the layer's: ``kv`` = the raw rows then the ratio-4 compressed entries, and each row
attends to its ``W`` window rows plus ``k`` entries drawn at random among those already complete
(standing in for the indexer's top-k). FLOPs are counted as ``4*T*H*d*(k+W)`` forward, 2.5x that backward.
"""

from __future__ import annotations

import torch

from ..registry import Case, Skip, register

DEFAULTS = dict(tokens=32768, heads=64, dim=512, topk=512, window=128, ratio=4, doc_len=0, seed=0)


def packed_indices(T: int, doc_len: int, window: int, topk: int, ratio: int, device,
                   gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """``indices [T, W+k]`` int32 (-1 = none) and ``N`` = T raw rows + compressed entries, docs of ``doc_len``."""
    doc_len = doc_len or T
    out = torch.full((T, window + topk), -1, dtype=torch.int32, device=device)
    comp_base, n_comp = T, 0
    for start in range(0, T, doc_len):
        L = min(doc_len, T - start)
        ne = L // ratio
        for lo in range(0, L, 4096):
            pos = torch.arange(lo, min(lo + 4096, L), device=device)
            win = start + pos[:, None] - torch.arange(window - 1, -1, -1, device=device)[None, :]
            out[start + pos, :window] = torch.where(win >= start, win, -1).int()
            if topk and ne:
                score = torch.rand(pos.numel(), ne, device=device, generator=gen)
                visible = (pos + 1) // ratio
                score.masked_fill_(torch.arange(ne, device=device)[None, :] >= visible[:, None], -1.0)
                val, sel = score.topk(min(topk, ne), dim=1)
                sel = torch.where(val >= 0, sel + comp_base + n_comp, -1).int()
                out[start + pos, window:window + sel.shape[1]] = sel
        n_comp += ne
    return out, T + n_comp


def attn_inputs(shape: dict, device, dtype) -> tuple:
    """``(q, kv, sink, idx, flops, info)``: the inputs of ``shape`` (the leaves require grad; ``idx`` int32), the
    nominal FLOPs and the facts every provider of this op records; the same tensors for the same shape and seed,
    whichever provider."""
    T, H, d = shape["tokens"], shape["heads"], shape["dim"]
    k, W = shape["topk"], shape["window"]
    gen = torch.Generator(device=device).manual_seed(shape["seed"])
    idx, N = packed_indices(T, shape["doc_len"], W, k, shape["ratio"], device, gen)
    q = torch.randn(T, H, d, device=device, dtype=dtype, generator=gen).requires_grad_()
    kv = torch.randn(N, d, device=device, dtype=dtype, generator=gen).requires_grad_()
    sink = torch.randn(H, device=device, dtype=torch.float32, generator=gen).requires_grad_()
    fwd = 4.0 * T * H * d * (k + W)
    return q, kv, sink, idx, {"fwd": fwd, "bwd": 2.5 * fwd}, {"N": N, "valid_keys_per_row": float((idx >= 0).sum()) / T}


def _build(shape: dict, device, dtype, backend: str, variant: str) -> Case:
    from csattn.ops.sparse_attn import sparse_attn

    q, kv, sink, idx, flops, info = attn_inputs(shape, device, dtype)
    scale = shape["dim"] ** -0.5
    config = None
    if backend == "triton":
        from csattn.ops.sparse_attn.config import SparseAttnConfig

        # variant "bk_fwd=32,fwd_gluon=0": the kernels' launch settings; the defaults otherwise
        try:
            config = SparseAttnConfig.parse(variant)
        except ValueError as e:
            raise Skip(f"bad variant {variant!r}: {e}") from e
        info["config"] = config.as_dict()
    elif variant:
        raise Skip(f"reference takes no variant, got {variant!r}")
    else:
        idx = idx.long()

    def forward():  # the autograd function keeps the config for the backward
        return sparse_attn(q, kv, idx, sink, scale, backend=backend, config=config)

    return Case(forward=forward, leaves=[q, kv, sink], flops=flops, info=info)


@register("sparse_attn", "triton", DEFAULTS)
def triton_provider(shape, device, dtype, variant=""):
    if device.type != "cuda":
        raise Skip("the Triton path is timed on CUDA only")
    return _build(shape, device, dtype, "triton", variant)


@register("sparse_attn", "reference", DEFAULTS)
def reference_provider(shape, device, dtype, variant=""):
    return _build(shape, device, dtype, "reference", variant)
