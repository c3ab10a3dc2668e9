"""Providers for ``--op indexer_topk``, ``--op indexer_loss`` and ``--op compressor``: the Triton kernels and
the PyTorch references on the same inputs, laid out like the layer's (packed documents of ``doc_len`` tokens,
ratio-4 entries, causal visibility per document).

FLOPs: top-k ``2*HI*cI`` per visible (row, entry) pair; sparse loss forward ``2*k*(HI*cI + H*d)`` per row,
backward ``6*k*HI*cI`` (student recompute, dq, dk; the teacher masses are kept from the forward); dense loss
the same with the visible count in place of ``k`` and the teacher recomputed in the backward. The compressor is
memory-bound: ``info`` records the bytes it moves.
"""

from __future__ import annotations

import torch

from ..registry import Case, Skip, register

TOPK_DEFAULTS = dict(tokens=32768, index_heads=64, index_dim=128, topk=512, ratio=4, doc_len=0, seed=0)
LOSS_DEFAULTS = dict(tokens=32768, index_heads=64, index_dim=128, heads=64, dim=512, topk=512, ratio=4,
                     doc_len=0, dense=0, seed=0)
POOL_DEFAULTS = dict(tokens=32768, dim=512, ratio=4, doc_len=0, seed=0)


def _meta(T: int, doc_len: int, ratio: int, device):
    from csattn.packing import PackedSeqs

    doc_len = doc_len or T
    lengths = [min(doc_len, T - s) for s in range(0, T, doc_len)]
    packed = PackedSeqs.from_lengths(lengths)
    return packed, packed.compress(ratio, device=device)


def _check(device, backend):
    if backend == "triton" and device.type != "cuda":
        raise Skip("the Triton path is timed on CUDA only")


def _config(cls, variant: str):
    """The variant string as the kernels' launch settings (a Skip naming a bad key)."""
    try:
        return cls.parse(variant)
    except ValueError as e:
        raise Skip(f"bad variant {variant!r}: {e}") from e


def _topk_case(shape, device, dtype, backend, variant) -> Case:
    from csattn.ops.indexer import indexer_topk

    _check(device, backend)
    if variant and backend != "triton":
        raise Skip(f"the reference takes no variant, got {variant!r}")
    config = None
    if backend == "triton":
        from csattn.ops.indexer import IndexerConfig

        # Variant "bt=64,bk=128,warps=8,stages=3" sets the score-kernel tiles (defaults otherwise).
        config = _config(IndexerConfig, variant)
    packed, meta, q, w, k, flops, info = topk_inputs(shape, device, dtype)

    def forward():
        return (indexer_topk(q, w, k, meta.vis_start, meta.vis_end, shape["topk"], backend=backend, config=config),)

    if config is not None:
        info["config"] = config.as_dict()
    return Case(forward=forward, leaves=[], flops=flops, info=info)


def topk_inputs(shape: dict, device, dtype) -> tuple:
    """``(packed, meta, q, w, k, flops, info)``: the documents and inputs of ``shape``, the nominal FLOPs and the
    facts every top-k provider records; the same tensors for the same shape and seed, whichever provider."""
    T, HI, CI = shape["tokens"], shape["index_heads"], shape["index_dim"]
    gen = torch.Generator(device=device).manual_seed(shape["seed"])
    packed, meta = _meta(T, shape["doc_len"], shape["ratio"], device)
    q = torch.randn(T, HI, CI, device=device, generator=gen).to(dtype)
    w = torch.randn(T, HI, device=device, generator=gen) * (CI * HI) ** -0.5
    k = torch.randn(meta.num_entries, CI, device=device, generator=gen).to(dtype)
    pairs = float((meta.vis_end - meta.vis_start).sum())
    return packed, meta, q, w, k, {"fwd": 2.0 * HI * CI * pairs}, {"entries": meta.num_entries,
                                                                    "visible_pairs": pairs}


@register("indexer_topk", "triton", TOPK_DEFAULTS)
def topk_triton(shape, device, dtype, variant=""):
    return _topk_case(shape, device, dtype, "triton", variant)


@register("indexer_topk", "reference", TOPK_DEFAULTS)
def topk_reference(shape, device, dtype, variant=""):
    return _topk_case(shape, device, dtype, "reference", variant)


@register("indexer_select", "triton", TOPK_DEFAULTS)
def select_triton(shape, device, dtype, variant=""):
    """The exact top-k selection alone (``select_topk`` over each row chunk's workspace of ordered int32 keys,
    the scores computed once beforehand), so a change to the selection is timed apart from the score kernel.
    ``info["bytes"]`` is one read of every visible key: the floor the selection would have at full bandwidth."""
    import csattn.ops.indexer.triton as kernels

    _check(device, "triton")
    config = _config(kernels.IndexerConfig, variant)
    _, meta, q, w, k, _, info = topk_inputs(shape, device, dtype)
    vs, ve = meta.vis_start.contiguous(), meta.vis_end.contiguous()
    plan = kernels._chunks(vs, ve, kernels._MAX_WORKSPACE)
    # one workspace a chunk (the kernels reuse one buffer; here each chunk keeps its scores between calls)
    scores = [kernels.indexer_scores_fwd(q, w, k, vs, ve, lo, hi, klo, khi, ordered_keys=True, config=config)
              for lo, hi, klo, khi, _ in plan]
    out = torch.empty((q.shape[0], shape["topk"]), dtype=torch.int64, device=device)

    def forward():
        for (lo, _, klo, _, widest), ws in zip(plan, scores):
            kernels.select_topk(ws, vs, ve, out, lo, klo, widest, config=config)
        return (out,)

    info.update(config=config.as_dict(), chunks=len(plan), bytes={"fwd": 4.0 * info["visible_pairs"]})
    return Case(forward=forward, leaves=[], flops={}, info=info)


def _loss_case(shape, device, dtype, backend, variant) -> Case:
    from csattn.ops.indexer import indexer_topk
    from csattn.ops.indexer_loss import indexer_kl_loss

    _check(device, backend)
    if variant and backend != "triton":
        raise Skip(f"the reference takes no variant, got {variant!r}")
    config = None
    if backend == "triton":
        from csattn.ops.indexer_loss import IndexerLossConfig

        # Variant "bk_fwd=64,bk_bwd=32,warps_fwd=8,warps_bwd=8" sets the loss kernels' tiles (defaults otherwise).
        config = _config(IndexerLossConfig, variant)
    T, HI, CI, H, D, K = (shape[k] for k in ("tokens", "index_heads", "index_dim", "heads", "dim", "topk"))
    gen = torch.Generator(device=device).manual_seed(shape["seed"])
    packed, meta = _meta(T, shape["doc_len"], shape["ratio"], device)
    Nc = meta.num_entries
    q_idx = torch.randn(T, HI, CI, device=device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(T, HI, device=device, generator=gen) * (CI * HI) ** -0.5).requires_grad_()
    k_idx = torch.randn(Nc, CI, device=device, generator=gen).to(dtype).requires_grad_()
    q = torch.randn(T, H, D, device=device, generator=gen).to(dtype)
    ckv = torch.randn(Nc, D, device=device, generator=gen).to(dtype)
    lse = torch.randn(T, H, device=device, generator=gen) + 8.0
    row_weight = torch.full((T,), 1.0 / T, device=device)
    dense = bool(shape["dense"])
    selected = None if dense else indexer_topk(q_idx.detach(), w.detach(), k_idx.detach(), meta.vis_start,
                                               meta.vis_end, K, backend="triton" if device.type == "cuda"
                                               else "reference")
    per_row = float((meta.vis_end - meta.vis_start).sum()) if dense else float((selected >= 0).sum())
    fwd = 2.0 * per_row * (HI * CI + H * D)
    bwd = 6.0 * per_row * HI * CI + (2.0 * per_row * H * D if dense else 0.0)

    def forward():
        return (indexer_kl_loss(q_idx, w, k_idx, q, ckv, lse, D**-0.5, row_weight, selected=selected,
                                vis_start=meta.vis_start, vis_end=meta.vis_end, backend=backend, config=config),)

    info = {"entries": Nc, "candidates": per_row}
    if config is not None:
        info["config"] = config.as_dict()
    return Case(forward=forward, leaves=[q_idx, w, k_idx], flops={"fwd": fwd, "bwd": bwd}, info=info)


@register("indexer_loss", "triton", LOSS_DEFAULTS)
def loss_triton(shape, device, dtype, variant=""):
    return _loss_case(shape, device, dtype, "triton", variant)


@register("indexer_loss", "reference", LOSS_DEFAULTS)
def loss_reference(shape, device, dtype, variant=""):
    return _loss_case(shape, device, dtype, "reference", variant)


def _pool_case(shape, device, dtype, backend, variant) -> Case:
    from csattn.ops.compressor import compress_pool

    _check(device, backend)
    if variant:
        raise Skip(f"no variants, got {variant!r}")
    T, c, r = shape["tokens"], shape["dim"], shape["ratio"]
    overlap = r == 4
    width = c * (2 if overlap else 1)
    gen = torch.Generator(device=device).manual_seed(shape["seed"])
    _, meta = _meta(T, shape["doc_len"], r, device)
    kv = torch.randn(T, width, device=device, generator=gen).to(dtype).requires_grad_()
    gate = torch.randn(T, width, device=device, generator=gen).to(dtype).requires_grad_()
    bias = torch.randn(r, width, device=device, generator=gen).requires_grad_()
    el = torch.finfo(dtype).bits // 8
    moved = {"fwd": 2 * T * width * el + meta.num_entries * c * el}
    moved["bwd"] = 2 * moved["fwd"] + 2 * T * width * el

    def forward():
        return (compress_pool(kv, gate, bias, meta.entry_row, meta.entry_first, r, overlap, backend=backend),)

    return Case(forward=forward, leaves=[kv, gate, bias], flops={}, info={"bytes": moved, "overlap": overlap})


@register("compressor", "triton", POOL_DEFAULTS)
def pool_triton(shape, device, dtype, variant=""):
    return _pool_case(shape, device, dtype, "triton", variant)


@register("compressor", "reference", POOL_DEFAULTS)
def pool_reference(shape, device, dtype, variant=""):
    return _pool_case(shape, device, dtype, "reference", variant)
