"""Providers for ``--op layer``: one whole attention layer (projections, compressor, indexer, sparse
attention, indexer loss, output projection) on a packed batch of documents.

- ``triton``: ``HybridAttention`` with the fused kernels (``backend="triton"``);
- ``reference``: ``HybridAttention`` with the plain-PyTorch ops (``backend="reference"``);
- ``hf``: Hugging Face ``DeepseekV4Attention`` (eager, dense masks) on the same weights. HF cannot pack, so
  it runs the documents as a batch ``[B, S, D]`` of equal length ``doc_len`` (one document if 0).

Geometry defaults to V4-Flash (D 4096, H 64, d 512, q_lora 1024, indexer 64 x 128, k 512, W 128).
FLOPs are the layer's matrix-multiply FLOPs (projections, compressors, indexer scores over the visible
entries, sparse attention over ``W + k`` keys); backward counted as 2x (attention 2.5x).
"""

from __future__ import annotations

import torch

from csattn.models.deepseek_v4.flops import layer_flops

from ..registry import Case, Skip, register

DEFAULTS = dict(tokens=32768, layer="csa", doc_len=0, hidden=4096, heads=64, dim=512, rope_dim=64, q_lora=1024,
                groups=8, o_lora=1024, topk=512, window=128, index_heads=64, index_dim=128, hca_ratio=128,
                loss_coeff=0.01, seed=0)


def attention_config(shape: dict, backend: str, sparse_attn_kernel=None):
    from csattn import AttentionConfig

    layer = shape["layer"]
    return AttentionConfig(
        hidden_size=shape["hidden"], num_heads=shape["heads"], head_dim=shape["dim"], rope_head_dim=shape["rope_dim"],
        q_lora_rank=shape["q_lora"], o_groups=shape["groups"], o_lora_rank=shape["o_lora"],
        sliding_window=shape["window"], layer_type=layer,
        compress_ratio={"sliding": 0, "csa": 4, "hca": shape["hca_ratio"]}[layer],
        index_n_heads=shape["index_heads"], index_head_dim=shape["index_dim"], index_topk=shape["topk"],
        rope_theta=10000.0 if layer == "sliding" else 160000.0,
        rope_scaling=None if layer == "sliding" else AttentionConfig().rope_scaling,
        indexer_loss_coeff=shape["loss_coeff"], backend=backend, sparse_attn_kernel=sparse_attn_kernel,
        # a "deterministic=1" variant is the layer's flag (it passes it to every kernel config)
        deterministic=bool(sparse_attn_kernel is not None and sparse_attn_kernel.deterministic),
    )


def doc_lengths(tokens: int, doc_len: int) -> list[int]:
    if not doc_len:
        return [tokens]
    lengths = [doc_len] * (tokens // doc_len)
    if tokens % doc_len:
        lengths.append(tokens % doc_len)
    return lengths


def _inputs(shape: dict, device, dtype):
    gen = torch.Generator(device=device).manual_seed(shape["seed"])
    x = torch.randn(shape["tokens"], shape["hidden"], device=device, dtype=dtype, generator=gen)
    return x.requires_grad_()


def _ours(shape, device, dtype, backend: str, variant: str = "") -> Case:
    from csattn import HybridAttention, PackedSeqs
    from csattn.ops.sparse_attn.config import SparseAttnConfig

    if variant and backend != "triton":
        raise Skip(f"the reference takes no variant, got {variant!r}")
    try:  # variant "bk_fwd=32,fwd_gluon=0": the sparse-attention kernels' launch settings
        kernel = SparseAttnConfig.parse(variant) if variant else None
    except ValueError as e:
        raise Skip(f"bad variant {variant!r}: {e}") from e
    torch.manual_seed(shape["seed"])
    layer = HybridAttention(attention_config(shape, backend, kernel)).to(device=device, dtype=dtype)
    lengths = doc_lengths(shape["tokens"], shape["doc_len"])
    packed = PackedSeqs.from_lengths(lengths, device=device)
    x = _inputs(shape, device, dtype)
    return Case(
        forward=lambda: (layer(x, packed=packed),),
        leaves=[x, *layer.parameters()],
        flops=layer_flops(layer.config, lengths),
        info={"docs": len(lengths), "backend": backend, **({"config": kernel.as_dict()} if kernel else {})},
    )


@register("layer", "triton", DEFAULTS)
def triton_layer(shape, device, dtype, variant=""):
    if device.type != "cuda":
        raise Skip("the Triton path is timed on CUDA only")
    return _ours(shape, device, dtype, "triton", variant)


@register("layer", "reference", DEFAULTS)
def reference_layer(shape, device, dtype, variant=""):
    return _ours(shape, device, dtype, "reference", variant)


@register("layer", "hf", DEFAULTS)
def hf_layer(shape, device, dtype, variant=""):
    from csattn.report.hf import build_hf_attention

    lengths = doc_lengths(shape["tokens"], shape["doc_len"])
    if len(set(lengths)) != 1:
        raise Skip("HF cannot pack ragged documents: use a doc_len that divides tokens")
    batch, seqlen = len(lengths), lengths[0]
    if seqlen > 16384:
        raise Skip(f"HF eager builds [B, H, S, S + S/r] scores: S = {seqlen} does not fit in memory")
    cfg = attention_config(shape, "reference")
    try:
        attn, run = build_hf_attention(cfg, device, dtype, seed=shape["seed"])
    except ImportError as e:
        raise Skip(f"transformers with DeepseekV4 is not installed ({e})") from e
    x = _inputs(shape, device, dtype).detach().view(batch, seqlen, -1).requires_grad_()
    return Case(forward=lambda: (run(x),), leaves=[x, *attn.parameters()], flops=layer_flops(cfg, lengths),
                info={"docs": batch, "layout": "batch"})
