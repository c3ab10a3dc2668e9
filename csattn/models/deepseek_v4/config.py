"""``DeepseekV4ModelConfig``: the fields of Hugging Face's ``DeepseekV4Config`` that the decoder needs, plus
training-only settings. Reads and writes the ``config.json`` of an HF-format checkpoint without importing
``transformers``."""

from __future__ import annotations

import copy
import numbers
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ...config import AttentionConfig
from ...ops.backend import BackendChoice, check_backend

__all__ = ["DeepseekV4ModelConfig", "HF_LAYER_TYPES", "MLP_LAYER_TYPES", "RECOMPUTE_CHOICES"]

HF_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_LAYER_TYPES = ("hash_moe", "moe")
_RATIO_TO_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
# Settings that only this library reads; they are not written into ``config.json``.
_TRAINING_FIELDS = ("indexer_loss_coeff", "mtp_loss_coeff", "mtp_layer_types", "backend",
                    "attn_chunk_rows", "workspace_bytes", "recompute", "moe_chunk_rows",
                    "sparse_attn_kernel", "indexer_kernel", "indexer_loss_kernel", "offload_block_inputs",
                    "deterministic")
# What the backward recomputes instead of keeping (``DeepseekV4ModelConfig.recompute``):
#   none  - each fused op keeps only what its own backward needs (the mHC and MoE kernels recompute their
#           elementwise parts by design); the sub-blocks' normed inputs and the first block's streams are rebuilt
#           in the backward from what it keeps anyway (the streams, the embedding), not kept by their consumers;
#   mhc   - also the whole mHC pre-mapping + RMSNorm before each sub-block (keeps the streams only, not the
#           site's logits, post and comb);
#   moe   - also the whole MoE (router, experts, shared expert): only its input is kept;
#   block - each decoder / MTP block from its input streams (about one extra forward); the first block starts from
#           the embedding ``[D]`` (not its ``n`` copies) and, without MTP blocks, the last one ends with the
#           hyper-head and final norm, so the model keeps one stream set per block boundary;
#   full  - block, with mhc and moe inside each recomputed block: the block's backward holds one sub-block's state
#           at a time (the longest sequences; the mHC sites and the MoE run three forwards).
RECOMPUTE_CHOICES = ("none", "mhc", "moe", "block", "full")
# the decoder's own integer fields (a float would slip through the range checks and fail deep inside a module)
_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "moe_intermediate_size", "n_routed_experts",
               "n_shared_experts", "num_experts_per_tok", "hc_mult", "hc_sinkhorn_iters", "num_nextn_predict_layers",
               "moe_chunk_rows")


@dataclass
class DeepseekV4ModelConfig:
    """Decoder geometry with HF's names (so ``AttentionConfig.from_hf(config, i)`` accepts it).

    Defaults are V4-Flash's, except the attention geometry which comes from :class:`AttentionConfig`.
    Build one from HF with :meth:`from_hf` (a ``DeepseekV4Config`` or a ``config.json`` dict).
    """

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    partial_rotary_factor: float = 64 / 512
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    layer_types: list[str] | None = None
    compress_rates: dict[str, int] = field(
        default_factory=lambda: {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_parameters: dict[str, Any] | None = None
    max_position_embeddings: int = 1048576
    # MoE
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    mlp_layer_types: list[str] | None = None
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # head / misc
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    # training-only (not in config.json)
    indexer_loss_coeff: float = 0.0
    mtp_loss_coeff: float = 0.3
    mtp_layer_types: list[str] = field(default_factory=lambda: ["sliding_attention"])
    # every op's kernels (attention, mHC, MoE, RMSNorm): "auto" = Triton on CUDA, the reference elsewhere
    backend: BackendChoice = "auto"
    attn_chunk_rows: int = 1024
    workspace_bytes: int = 1 << 30
    recompute: str = "none"  # one of RECOMPUTE_CHOICES (see there)
    # tokens per MoE pass: the experts' forward and backward temporaries ([T k, D] gathers, products) scale with
    # the rows of one pass, about 57 KiB a token at V4-Flash's geometry (top-2), 28 GiB at 512k tokens at once
    moe_chunk_rows: int = 65536
    # under block / full recompute, keep each decoder block's saved input (its streams) in pinned host memory
    # instead of on the GPU: 32 KiB a token a block at V4-Flash's geometry, copied back for its recomputation
    offload_block_inputs: bool = False
    # launch settings of the fused sparse attention, every layer: a SparseAttnConfig.parse string ("" = the tuned
    # defaults), kept as a string so the training settings stay JSON
    sparse_attn_kernel: str = ""
    indexer_kernel: str = ""  # IndexerConfig.parse string, every CSA layer
    indexer_loss_kernel: str = ""  # IndexerLossConfig.parse string, every CSA layer
    # every layer's AttentionConfig.deterministic: the fused kernels' scatter-add gradients in exact fixed point
    # (bitwise reproducible backward; with csattn.deterministic_mode() for the torch ops)
    deterministic: bool = False

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if self.layer_types is None:  # HF's default: the Pro pattern (2 x HCA, then CSA on odd indices)
            rest = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                    for i in range(max(n - 2, 0))]
            self.layer_types = ["heavily_compressed_attention"] * min(n, 2) + rest
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["hash_moe"] * min(n, 3) + ["moe"] * max(0, n - 3)
        self.layer_types = list(self.layer_types)[:n]
        self.mlp_layer_types = list(self.mlp_layer_types)[:n]
        self.compress_rates = dict(self.compress_rates)
        if self.rope_parameters is None or not isinstance(self.rope_parameters.get("main"), dict):
            extra = {k: v for k, v in (self.rope_parameters or {}).items() if k not in ("main", "compress")}
            compress = {**extra, "rope_theta": self.compress_rope_theta,
                        "partial_rotary_factor": self.partial_rotary_factor}
            compress.setdefault("rope_type", "default")
            if compress["rope_type"] == "yarn":
                compress.setdefault("attention_factor", 1.0)
            self.rope_parameters = {
                "main": {"rope_type": "default", "rope_theta": self.rope_theta,
                         "partial_rotary_factor": self.partial_rotary_factor},
                "compress": compress,
            }
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ``ValueError`` naming the field on inconsistent settings."""
        for name in _INT_FIELDS:  # the attention's sizes are checked by AttentionConfig (attention_config below)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        n = self.num_hidden_layers
        if n < 1 or self.vocab_size < 1 or self.moe_intermediate_size < 1 or self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_hidden_layers, vocab_size and moe_intermediate_size must be >= 1 and "
                             f"num_nextn_predict_layers >= 0, got {n}, {self.vocab_size}, "
                             f"{self.moe_intermediate_size}, {self.num_nextn_predict_layers}")
        for name, types, allowed in (("layer_types", self.layer_types, HF_LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES)):
            if len(types) != n:
                raise ValueError(f"{name} has {len(types)} entries but num_hidden_layers is {n}")
            bad = [t for t in types if t not in allowed]
            if bad:
                raise ValueError(f"{name} entries must be one of {allowed}, got {bad}")
        if len(self.mtp_layer_types) < self.num_nextn_predict_layers:
            raise ValueError(f"mtp_layer_types needs {self.num_nextn_predict_layers} entries, "
                             f"got {self.mtp_layer_types}")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, n_routed_experts={self.n_routed_experts}], "
                             f"got {self.num_experts_per_tok}")
        check_backend(self.backend)
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(f"scoring_func must be sqrtsoftplus, sigmoid or softmax, got {self.scoring_func!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.n_shared_experts != 1:
            # HF (and the checkpoints) have exactly one shared expert of moe_intermediate_size.
            raise ValueError(f"n_shared_experts must be 1, got {self.n_shared_experts}")
        if self.offload_block_inputs and self.recompute not in ("block", "full"):
            raise ValueError("offload_block_inputs keeps the inputs of recomputed blocks: it needs recompute='block' "
                             f"or 'full', got recompute={self.recompute!r}")
        if self.moe_chunk_rows < 1:
            raise ValueError(f"moe_chunk_rows must be >= 1, got {self.moe_chunk_rows}")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_CHOICES}, got {self.recompute!r}")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            raise ValueError(f"hc_mult and hc_sinkhorn_iters must be >= 1, got {self.hc_mult}, "
                             f"{self.hc_sinkhorn_iters}")
        for i in range(n):
            self.attention_config(i)  # AttentionConfig checks the attention geometry

    # ------------------------------------------------------------------ per-layer views
    def attention_config(self, layer_idx: int) -> AttentionConfig:
        """The :class:`AttentionConfig` of decoder layer ``layer_idx``; ``num_hidden_layers + j`` is MTP block j."""
        n = self.num_hidden_layers
        if layer_idx >= n:
            j = layer_idx - n
            if j >= len(self.mtp_layer_types):
                raise ValueError(f"layer_idx {layer_idx} is past the decoder and the MTP blocks")
            view = replace(self, num_hidden_layers=1, layer_types=[self.mtp_layer_types[j]],
                           mlp_layer_types=["moe"], num_nextn_predict_layers=0)
            return view.attention_config(0)
        return AttentionConfig.from_hf(
            self, layer_idx, indexer_loss_coeff=self.indexer_loss_coeff, backend=self.backend,
            attn_chunk_rows=self.attn_chunk_rows, workspace_bytes=self.workspace_bytes,
            sparse_attn_kernel=self.sparse_attn_kernel or None, indexer_kernel=self.indexer_kernel or None,
            indexer_loss_kernel=self.indexer_loss_kernel or None, deterministic=self.deterministic,
        )

    # ------------------------------------------------------------------ HF interchange
    @classmethod
    def from_hf(cls, hf_config: Any, **overrides: Any) -> DeepseekV4ModelConfig:
        """From a ``transformers.DeepseekV4Config`` or a ``config.json`` dict (legacy keys accepted:
        ``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, ``n_layers``-style names are not)."""
        src = dict(hf_config) if isinstance(hf_config, dict) else hf_config.to_dict()
        src = copy.deepcopy(src)
        model_type = src.get("model_type", "deepseek_v4")
        if model_type != "deepseek_v4":
            raise ValueError(f"config model_type must be 'deepseek_v4', got {model_type!r}")
        # Training fields found in the dict (a config.json written with training_dict() merged in, or a dict
        # built by hand) are taken, not dropped; overrides still win over them.
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in src.items() if k in names}
        if "attention_backend" in overrides:
            raise ValueError("DeepseekV4ModelConfig: attention_backend= is now backend= (same values: 'auto', "
                             f"'reference', 'triton'), got attention_backend={overrides['attention_backend']!r}")
        if "attention_backend" in src and "backend" not in src:  # training settings saved before the rename
            kwargs["backend"] = src["attention_backend"]
        n = int(src.get("num_hidden_layers", cls.num_hidden_layers))
        ratios = src.get("compress_ratios")
        if kwargs.get("layer_types") is None and ratios is not None:
            kwargs["layer_types"] = [_RATIO_TO_TYPE[int(r)] for r in ratios][:n]
        if ratios is not None and len(ratios) > n and "mtp_layer_types" not in overrides:
            # the release lists the MTP blocks' attention after the decoder's (sliding for V4)
            kwargs["mtp_layer_types"] = [_RATIO_TO_TYPE[int(r)] for r in ratios[n:]]
        if kwargs.get("mlp_layer_types") is None and src.get("num_hash_layers") is not None:
            h = int(src["num_hash_layers"])
            kwargs["mlp_layer_types"] = ["hash_moe"] * min(n, h) + ["moe"] * max(0, n - h)
        if kwargs.get("partial_rotary_factor") is None:
            rope_dim = src.get("qk_rope_head_dim")
            head_dim = int(src.get("head_dim", cls.head_dim))
            kwargs["partial_rotary_factor"] = rope_dim / head_dim if rope_dim is not None else 64 / 512
        if kwargs.get("compress_rates") is None:
            kwargs.pop("compress_rates", None)
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` contents (loadable by ``transformers.DeepseekV4Config``)."""
        out = {k: v for k, v in asdict(self).items() if k not in _TRAINING_FIELDS}
        out.update(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], num_key_value_heads=1,
                   qk_rope_head_dim=int(self.head_dim * self.partial_rotary_factor), norm_topk_prob=True,
                   attention_bias=False, mlp_bias=False)
        return copy.deepcopy(out)

    def training_dict(self) -> dict[str, Any]:
        """The training-only settings (kept beside ``config.json`` in training checkpoints)."""
        return {k: copy.deepcopy(getattr(self, k)) for k in _TRAINING_FIELDS}
