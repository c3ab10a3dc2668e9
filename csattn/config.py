"""Configuration of one hybrid attention layer."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Literal

from .ops.backend import BackendChoice, check_backend
from .ops.indexer.config import IndexerConfig
from .ops.indexer_loss.config import IndexerLossConfig
from .ops.rope import YarnScaling
from .ops.sparse_attn.config import SparseAttnConfig

__all__ = ["AttentionConfig", "LAYER_TYPES"]

LayerType = Literal["sliding", "csa", "hca"]
LAYER_TYPES: tuple[str, ...] = ("sliding", "csa", "hca")

# integer fields (compress_ratio is checked with the layer type: 0 on sliding layers)
_INT_FIELDS = ("hidden_size", "num_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
               "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "workspace_bytes", "attn_chunk_rows")

_HF_LAYER_TYPES = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}


@dataclass
class AttentionConfig:
    """One DeepSeek-V4 attention layer.

    ``layer_type``: ``"sliding"`` (window only, "W"), ``"csa"`` (overlapping compressor of ratio
    ``compress_ratio`` + lightning indexer + top-k) or ``"hca"`` (non-overlapping compressor, every visible
    entry attended). Defaults are V4-Flash's attention geometry.
    """

    hidden_size: int = 4096
    num_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    layer_type: LayerType = "csa"
    compress_ratio: int = 4
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = field(default_factory=YarnScaling)
    rms_norm_eps: float = 1e-6
    # indexer loss (CSA layers)
    indexer_loss_coeff: float = 0.0
    indexer_loss_type: Literal["sparse", "dense"] = "sparse"
    compute_indexer_loss: bool = True  # computed whenever gradients are enabled
    # execution
    # bound on the workspace of one row chunk / block: indexer scores, and the per-head temporaries of one
    # block of the layer core (which sets the core's block height)
    workspace_bytes: int = 1 << 30
    attn_chunk_rows: int = 1024  # rows per chunk of the reference sparse attention
    # run the per-head core (query heads -> sparse attention -> output projection) block by block and
    # recompute each block in the backward (csattn/layers/core.py), so no [T, H, d] tensor is kept; False keeps
    # q and o whole (plain autograd around the ops)
    recompute_projections: bool = True
    backend: BackendChoice = "auto"  # the kernels of every op the layer runs (csattn.ops.backend)
    # launch settings of the fused sparse-attention kernels (tile sizes, Gluon or Triton); None: the tuned
    # defaults. A "key=value,..." string or a dict (SparseAttnConfig.parse / as_dict) is converted on construction
    sparse_attn_kernel: SparseAttnConfig | None = None
    # likewise for the indexer's score / selection kernels and the indexer loss's kernels
    indexer_kernel: IndexerConfig | None = None
    indexer_loss_kernel: IndexerLossConfig | None = None
    # no host sync and no data-dependent shape in the forward/backward (CUDA graphs, torch.compile): static
    # metadata from device cu_seqlens (csattn.capture_safe); needs max_seqlen on the host; with cp=, the contiguous
    # partition only
    capture_safe: bool = False
    # bitwise reproducible backward: the fused kernels sum their scatter-add gradients (sparse attention's key
    # gradient, the indexer loss's) in exact fixed point instead of fp32 atomics (csattn/ops/fixed_point.py). The
    # one flag: it sets deterministic on sparse_attn_kernel and indexer_loss_kernel, which must not ask for it on
    # their own. The torch ops around them need csattn.deterministic_mode() too (csattn/deterministic.py)
    deterministic: bool = False

    def __post_init__(self) -> None:
        self.sparse_attn_kernel = SparseAttnConfig.coerce(self.sparse_attn_kernel)
        self.indexer_kernel = IndexerConfig.coerce(self.indexer_kernel)
        self.indexer_loss_kernel = IndexerLossConfig.coerce(self.indexer_loss_kernel)
        for name in ("sparse_attn_kernel", "indexer_loss_kernel"):
            kernel = getattr(self, name)
            if kernel is not None and kernel.deterministic and not self.deterministic:
                raise ValueError(f"{name} asks for deterministic=1: set AttentionConfig.deterministic=True "
                                 "(DeepseekV4ModelConfig.deterministic for a model) instead, which passes it to the "
                                 "kernel configs")
        if self.deterministic:
            self.sparse_attn_kernel = (self.sparse_attn_kernel or SparseAttnConfig()).replace(deterministic=True)
            self.indexer_loss_kernel = (self.indexer_loss_kernel or IndexerLossConfig()).replace(deterministic=True)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field on inconsistent settings."""
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(f"layer_type must be one of {LAYER_TYPES}, got {self.layer_type!r}")
        check_backend(self.backend)
        # sizes must be ints: a float slips through the range checks below and fails deep inside an op
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        for name, low in (("rope_theta", 0.0), ("rms_norm_eps", 0.0), ("indexer_loss_coeff", None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or (
                    value < 0 if low is None else value <= low):
                need = ">= 0" if low is None else "> 0"
                raise ValueError(f"{name} must be a finite number {need}, got {value!r}")
        if self.workspace_bytes < 1 or self.attn_chunk_rows < 1:
            raise ValueError(f"workspace_bytes and attn_chunk_rows must be >= 1, got {self.workspace_bytes}, "
                             f"{self.attn_chunk_rows}")
        for name in ("hidden_size", "num_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                     "sliding_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.rope_head_dim < 0 or self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            raise ValueError(
                f"rope_head_dim must be even and <= head_dim ({self.head_dim}), got {self.rope_head_dim}"
            )
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"o_groups ({self.o_groups}) must divide num_heads * head_dim")
        if self.layer_type == "sliding":
            return
        if not isinstance(self.compress_ratio, int) or self.compress_ratio < 1:
            raise ValueError(f"compress_ratio must be a positive int for a {self.layer_type} layer, "
                             f"got {self.compress_ratio!r}")
        if self.layer_type == "csa":
            if self.index_topk < 1:
                raise ValueError(f"index_topk must be >= 1, got {self.index_topk}")
            if self.index_n_heads < 1 or self.index_head_dim < self.rope_head_dim:
                raise ValueError("index_n_heads must be >= 1 and index_head_dim >= rope_head_dim "
                                 f"(got {self.index_n_heads}, {self.index_head_dim})")
            if self.indexer_loss_type not in ("sparse", "dense"):
                raise ValueError(f"indexer_loss_type must be 'sparse' or 'dense', got {self.indexer_loss_type!r}")

    @property
    def overlap(self) -> bool:
        """CSA compressors pool overlapping windows of 2r tokens."""
        return self.layer_type == "csa"

    @property
    def has_compressor(self) -> bool:
        return self.layer_type != "sliding"

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @classmethod
    def from_hf(cls, hf_config: Any, layer_idx: int, **overrides: Any) -> AttentionConfig:
        """Build from a ``transformers.DeepseekV4Config`` for layer ``layer_idx``."""
        layer_types = list(hf_config.layer_types)
        if not 0 <= layer_idx < len(layer_types):
            raise ValueError(f"layer_idx {layer_idx} is out of range for {len(layer_types)} layers")
        hf_type = layer_types[layer_idx]
        if hf_type not in _HF_LAYER_TYPES:
            raise ValueError(f"unknown layer type {hf_type!r} at layer {layer_idx}")
        layer_type = _HF_LAYER_TYPES[hf_type]
        rates = hf_config.compress_rates
        rope_key = "main" if layer_type == "sliding" else "compress"
        rope = hf_config.rope_parameters[rope_key]
        yarn = None
        if rope.get("rope_type", "default") == "yarn":
            yarn = YarnScaling(
                factor=float(rope["factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                beta_fast=float(rope.get("beta_fast") or 32),
                beta_slow=float(rope.get("beta_slow") or 1),
                truncate=bool(hf_config.rope_parameters.get("truncate", True)),
            )
        elif rope.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}")
        kwargs: dict[str, Any] = dict(
            hidden_size=hf_config.hidden_size,
            num_heads=hf_config.num_attention_heads,
            head_dim=hf_config.head_dim,
            rope_head_dim=int(hf_config.head_dim * rope.get("partial_rotary_factor", 1.0)),
            q_lora_rank=hf_config.q_lora_rank,
            o_groups=hf_config.o_groups,
            o_lora_rank=hf_config.o_lora_rank,
            sliding_window=hf_config.sliding_window,
            layer_type=layer_type,
            compress_ratio=int(rates.get(hf_type, 0)) if layer_type != "sliding" else 0,
            index_n_heads=hf_config.index_n_heads,
            index_head_dim=hf_config.index_head_dim,
            index_topk=hf_config.index_topk,
            rope_theta=float(rope["rope_theta"]),
            rope_scaling=yarn,
            rms_norm_eps=hf_config.rms_norm_eps,
        )
        kwargs.update(overrides)
        return cls(**kwargs)
