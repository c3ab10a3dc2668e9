"""Helpers that run Hugging Face's ``DeepseekV4Attention`` (transformers 5.23, eager) as an oracle."""

from __future__ import annotations

import torch

HF_TYPES = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}


def tiny_hf_config(layer_type: str, *, hca_ratio: int = 8, window: int = 8, topk: int = 3, yarn: bool = True,
                   index_heads: int = 8):
    from transformers import DeepseekV4Config

    types = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    rope = {"rope_theta": 10000.0}
    compress = {"rope_theta": 160000.0, "rope_type": "default"}
    if yarn:
        compress = {"rope_theta": 160000.0, "rope_type": "yarn", "factor": 4.0,
                    "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                    "attention_factor": 1.0}
    cfg = DeepseekV4Config(
        vocab_size=32, hidden_size=48, num_attention_heads=4, head_dim=32, q_lora_rank=24, o_groups=2,
        o_lora_rank=16, sliding_window=window, num_hidden_layers=3, layer_types=types,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca_ratio},
        index_n_heads=index_heads, index_head_dim=16, index_topk=topk, partial_rotary_factor=8 / 32,
        rope_parameters={"main": {"rope_type": "default", "partial_rotary_factor": 0.25, **rope},
                         "compress": {"partial_rotary_factor": 0.25, **compress}},
        max_position_embeddings=128, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        num_nextn_predict_layers=0,
    )
    cfg._attn_implementation = "eager"
    return cfg, types.index(HF_TYPES[layer_type])


def randomize_(module: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("position_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def hf_attention_forward(hf_attn, hf_cfg, x: torch.Tensor) -> torch.Tensor:
    """Run HF's layer on ``x [B, S, D]`` with its sliding-window causal mask."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    b, s, _ = x.shape
    pos = torch.arange(s)[None].expand(b, -1)
    rotary = DeepseekV4RotaryEmbedding(hf_cfg)
    emb = {k: rotary(x, pos, layer_type=k) for k in ("main", "compress")}
    q_idx = torch.arange(s)[:, None]
    k_idx = torch.arange(s)[None, :]
    allowed = (k_idx <= q_idx) & (k_idx > q_idx - hf_cfg.sliding_window)
    mask = torch.zeros(s, s, dtype=x.dtype).masked_fill(~allowed, float("-inf"))[None, None].expand(b, 1, s, s)
    out, _ = hf_attn(x, emb, pos, mask, None)
    return out
