"""Hugging Face ``DeepseekV4Attention`` (eager) on a csattn geometry: the baseline of the benchmarks."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..config import AttentionConfig

__all__ = ["build_hf_attention", "build_hf_model"]

_HF_TYPES = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
             "hca": "heavily_compressed_attention"}


def build_hf_attention(cfg: AttentionConfig, device: torch.device, dtype: torch.dtype, seed: int = 0
                       ) -> tuple[torch.nn.Module, Callable[[Tensor], Tensor]]:
    """HF's layer with ``cfg``'s geometry (weights ~ N(0, 0.02)) and a function running it on ``x [B, S, D]``
    with its dense sliding-window causal mask. Raises ``ImportError`` without transformers' DeepseekV4."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding

    yarn = cfg.rope_scaling
    compress = {"rope_type": "default"} if yarn is None else {
        "rope_type": "yarn", "factor": yarn.factor, "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
        "original_max_position_embeddings": yarn.original_max_position_embeddings}
    hf_cfg = DeepseekV4Config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads, head_dim=cfg.head_dim,
        partial_rotary_factor=cfg.rope_head_dim / cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, sliding_window=cfg.sliding_window,
        num_hidden_layers=1, layer_types=[_HF_TYPES[cfg.layer_type]],
        compress_rates={"compressed_sparse_attention": cfg.compress_ratio if cfg.layer_type == "csa" else 4,
                        "heavily_compressed_attention": cfg.compress_ratio if cfg.layer_type == "hca" else 128},
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        rope_parameters=compress, compress_rope_theta=cfg.rope_theta,
        n_routed_experts=4, num_experts_per_tok=2, num_nextn_predict_layers=0,
    )
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = DeepseekV4Attention(hf_cfg, 0)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.02)
    attn = attn.to(device=device, dtype=dtype)
    rotary = DeepseekV4RotaryEmbedding(hf_cfg).to(device)

    def run(x: Tensor) -> Tensor:
        b, s, _ = x.shape
        pos = torch.arange(s, device=x.device)[None].expand(b, -1)
        qi, ki = pos[0][:, None], pos[0][None, :]
        allowed = (ki <= qi) & (ki > qi - cfg.sliding_window)
        mask = torch.zeros(s, s, device=x.device, dtype=x.dtype).masked_fill(~allowed, float("-inf"))
        emb = {k: rotary(x, pos, layer_type=k) for k in ("main", "compress")}
        return attn(x, emb, pos, mask[None, None].expand(b, 1, s, s), None)[0]

    return attn, run


def build_hf_model(config, state_dict: dict[str, Tensor], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """HF's ``DeepseekV4ForCausalLM`` (eager attention and experts) of a ``DeepseekV4ModelConfig`` holding
    ``state_dict`` (csattn's names are HF's), in ``dtype`` with HF's own fp32 modules kept in fp32. Raises
    ``ImportError`` without transformers' DeepseekV4."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf_cfg = DeepseekV4Config(**{k: v for k, v in config.to_hf_dict().items() if k != "model_type"})
    hf_cfg._attn_implementation = "eager"
    hf_cfg._experts_implementation = "eager"
    with torch.device(device):  # HF's RoPE buffers are not in the state dict: build it for real
        model = DeepseekV4ForCausalLM(hf_cfg)
    model.load_state_dict(state_dict, strict=True)
    model = model.to(dtype)
    for name, p in model.named_parameters():  # HF's _keep_in_fp32_modules_strict, from the fp32 values
        if any(part in ("attn_hc", "ffn_hc", "hc_head", "sinks") for part in name.split(".")) or "norm" in name:
            p.data = state_dict[name].detach().to(device=device, dtype=torch.float32)
    return model
