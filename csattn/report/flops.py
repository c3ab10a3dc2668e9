"""Matrix-multiply FLOPs of one attention layer on a packed batch (the numerator of reported TFLOP/s)."""

from __future__ import annotations

import torch

from ..config import AttentionConfig

__all__ = ["layer_flops"]


def layer_flops(cfg: AttentionConfig, lengths: list[int]) -> dict[str, float]:
    """``{"fwd": ..., "bwd": ...}`` for documents of ``lengths`` real tokens.

    Counts the projections, the compressors, the indexer scores over every visible entry and the sparse
    attention over the attended keys (``4 * H * d`` per key and row). Backward is 2x the forward for the
    matrix products and 2.5x for attention (score recomputation).
    """
    T = sum(lengths)
    D, H, d = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    ql, ol, g = cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups
    proj = 2.0 * T * (D * ql + ql * H * d + D * d + H * d * ol + g * ol * D)
    pos = [torch.arange(L, dtype=torch.float64) for L in lengths]
    keys = sum(float((p + 1).clamp(max=cfg.sliding_window).sum()) for p in pos)
    scores = 0.0
    if cfg.layer_type == "csa":
        r, HI, cI = cfg.compress_ratio, cfg.index_n_heads, cfg.index_head_dim
        proj += 2.0 * T * (2 * D * 2 * d + ql * HI * cI + D * HI + 2 * D * 2 * cI)
        visible = sum(float(((p + 1) // r).sum()) for p in pos)
        scores = 2.0 * HI * cI * visible
        keys += sum(float(((p + 1) // r).clamp(max=cfg.index_topk).sum()) for p in pos)
    elif cfg.layer_type == "hca":
        proj += 2.0 * T * 2 * D * d
        keys += sum(float(((p + 1) // cfg.compress_ratio).sum()) for p in pos)
    attn = 4.0 * H * d * keys
    return {"fwd": proj + scores + attn, "bwd": 2 * proj + 2 * scores + 2.5 * attn}
