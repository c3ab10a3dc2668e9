"""Shared helpers of the model tests: tiny HF configs and models made with ``transformers`` itself."""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig

W, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
PATTERNS = {
    # Flash-like: window-only first layers, then CSA / HCA interleaved; first MoE layers hash-routed
    "flash": ([W, W, C, H], ["hash_moe", "hash_moe", "moe", "moe"]),
    # Pro-like: HCA first, then CSA / HCA
    "pro": ([H, H, C, H], ["hash_moe", "moe", "moe", "moe"]),
    "mixed": ([C, W, H], ["moe", "hash_moe", "moe"]),
}


def tiny_config_dict(pattern: str = "flash", *, vocab: int = 64, hca_ratio: int = 8, window: int = 8,
                     topk: int = 3, yarn: bool = True, mtp: int = 0, hc_mult: int = 4, tie: bool = False) -> dict:
    layer_types, mlp_types = PATTERNS[pattern]
    compress = {"rope_theta": 160000.0, "rope_type": "default", "partial_rotary_factor": 0.25}
    if yarn:
        compress.update(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32.0,
                        beta_slow=1.0, attention_factor=1.0)
    return dict(
        model_type="deepseek_v4", vocab_size=vocab, hidden_size=32, num_attention_heads=4, head_dim=32,
        q_lora_rank=24, o_groups=2, o_lora_rank=16, sliding_window=window, num_hidden_layers=len(layer_types),
        layer_types=layer_types, mlp_layer_types=mlp_types,
        # 8 indexer heads: with few heads the ReLU scores of several entries are often exactly 0, and a top-k
        # over exact ties may pick either entry (HF and we both pick validly but differently)
        # 8 indexer heads: with few heads the ReLU scores of several entries are often exactly 0, and a top-k
        # over exact ties may validly pick either entry (HF and this library then differ)
        compress_rates={C: 4, H: hca_ratio}, index_n_heads=8, index_head_dim=16, index_topk=topk,
        partial_rotary_factor=0.25,
        rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                         "compress": compress},
        max_position_embeddings=128, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        num_nextn_predict_layers=mtp, hc_mult=hc_mult, hc_sinkhorn_iters=20, tie_word_embeddings=tie,
    )


def hf_model(cfg_dict: dict, seed: int = 0):
    """A ``transformers.DeepseekV4ForCausalLM`` with random (non-default) weights, eager kernels."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(**{k: v for k, v in cfg_dict.items() if k != "model_type"})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).float()
    randomize_model_(model, seed + 1)
    return model


def randomize_model_(model: torch.nn.Module, seed: int) -> None:
    """Random values everywhere a default init would hide a bug (zero biases, unit scales, zero tables)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("inv_freq"):
                continue
            if name.endswith("tid2eid"):
                vocab, k = p.shape
                n_exp = int(model.config.n_routed_experts)
                p.copy_(torch.rand(vocab, n_exp, generator=g).argsort(-1)[:, :k])
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("sinks", "e_score_correction_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith(("position_bias", ".base", "hc_base")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith((".scale", "hc_scale")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.is_floating_point():
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def tiny_model(pattern: str = "flash", seed: int = 0, **kwargs) -> DeepseekV4ForCausalLM:
    """Our model on a tiny config with random non-default weights (no transformers needed)."""
    training = ("indexer_loss_coeff", "mtp_loss_coeff", "recompute", "mtp_layer_types")
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in training}
    cfg = DeepseekV4ModelConfig.from_hf(tiny_config_dict(pattern, **kwargs), **overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg)
    randomize_model_(model, seed + 1)
    return model


def disk(path: str, key: str) -> torch.Tensor:
    """The tensor ``key`` as a checkpoint directory ``path`` holds it on disk (whichever shard has it)."""
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), "pt") as f:
                if key in f.keys():
                    return f.get_tensor(key)
    raise KeyError(key)
