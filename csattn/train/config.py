"""The options of a training run: :class:`TrainConfig` (every ``csattn train`` flag), the range of each (``RULES``,
checked by :meth:`TrainConfig.validate` and by the command line's argument types alike) and the CPU-sized model of
the examples and tests (:func:`tiny_model_config`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..finetune.precision import check_base_precision
from ..finetune.setup import Finetune
from ..models.deepseek_v4 import DeepseekV4ModelConfig
from .errors import UserError

__all__ = ["DEFAULT_SAVE_MINUTES", "RULES", "TrainConfig", "tiny_model_config"]


def _damaged_init_from(path: str) -> str | None:
    """Why the ``--init-from`` directory, a checkpoint of ``csattn train`` (it has a manifest), is damaged; None if
    it is intact or has no manifest (an HF download). Sizes only (no file is read: every rank checks the same files
    alike at startup), which finds a truncated or missing file."""
    from .checkpoint.manifest import MANIFEST, verify_checkpoint

    if not os.path.isfile(os.path.join(path, MANIFEST)):
        return None
    return verify_checkpoint(path, deep=False, collective=False)


def tiny_model_config(vocab_size: int = 256, **overrides: Any) -> DeepseekV4ModelConfig:
    """A CPU-sized model that still has every part: W, CSA and HCA layers, hash and learned MoE, MTP.

    Its 4 indexer heads make exact top-k score ties common (every head's ReLU off): csattn gives a tie to the
    earlier entry, HF's ``torch.topk`` to either, so past ~90 tokens it is not a config for HF parity checks
    (those use 8 or more heads, as the tests do; V4 has 64)."""
    w, c, h = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
        partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=16,
        layer_types=[w, c, h, c], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={c: 4, h: 16}, index_n_heads=4, index_head_dim=16, index_topk=8,
        rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                         "compress": {"rope_type": "default", "rope_theta": 160000.0,
                                      "partial_rotary_factor": 0.25}},
        max_position_embeddings=4096, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        hc_mult=4, hc_sinkhorn_iters=20, num_nextn_predict_layers=1,
    )
    kwargs.update(overrides)
    return DeepseekV4ModelConfig(**kwargs)


DEFAULT_SAVE_MINUTES = 30.0  # time-based checkpoints of a run with --output and no --save-every


def _finite(lo: float, hi: float = math.inf, lo_open: bool = False, hi_open: bool = True) -> Any:
    def ok(v: float) -> bool:
        return math.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    return ok


def _at_least(lo: int) -> Any:
    return lambda v: v >= lo


# the range of each option, checked by TrainConfig.validate and, at parse time, by the command line's types (one
# table, so the API and `csattn train` refuse the same values): name -> (check, what a valid value is)
RULES: dict[str, tuple[Any, str]] = {
    "steps": (_at_least(1), "an integer >= 1"),
    "seq_len": (_at_least(2), "an integer >= 2 (a packed sequence needs an input row and its next token)"),
    "pad_multiple": (_at_least(1), "an integer >= 1"),
    "doc_min_len": (_at_least(2), "an integer >= 2"),
    "doc_max_len": (_at_least(2), "an integer >= 2"),
    "vocab_size": (_at_least(4), "an integer >= 4"),
    "mtp_layers": (_at_least(0), "an integer >= 0"),
    "lr": (_finite(0), "a finite number >= 0 (the peak learning rate; 0 leaves the weights as they are)"),
    "min_lr": (_finite(0), "a finite number >= 0 and <= --lr"),
    "warmup_steps": (_at_least(0), "an integer >= 0"),
    "weight_decay": (_finite(0), "a finite number >= 0"),
    "beta1": (_finite(0, 1), "a finite number in [0, 1)"),
    "beta2": (_finite(0, 1), "a finite number in [0, 1)"),
    "adam_eps": (_finite(0, lo_open=True), "a finite number > 0"),
    "grad_clip": (_finite(0), "a finite number >= 0 (0 = no clipping)"),
    "indexer_loss_coeff": (_finite(0), "a finite number >= 0"),
    "mtp_loss_coeff": (_finite(0), "a finite number >= 0"),
    "router_bias_rate": (_finite(0), "a finite number >= 0 (0 = no load balancing)"),
    "max_bad_steps": (_at_least(1), "an integer >= 1"),
    "dp_replicate": (_at_least(1), "an integer >= 1"),
    "cp": (_at_least(1), "an integer >= 1"),
    "ep": (_at_least(1), "an integer >= 1"),
    "batch_seqs": (_at_least(0), "an integer >= 0 (0 = one per data replica)"),
    "dist_timeout": (_finite(0, lo_open=True), "a finite number of seconds > 0"),
    "save_every": (_at_least(0), "an integer >= 0 (0 = no step interval: the final checkpoint and the time-based "
                   "ones of --save-every-minutes)"),
    "save_every_minutes": (_finite(0), "a finite number >= 0 (0 = no time-based checkpoints)"),
    "keep_last": (_at_least(1), "an integer >= 1 (leave it out to keep every checkpoint)"),
    "log_every": (_at_least(1), "an integer >= 1"),
    "peak_tflops": (_finite(0), "a finite number >= 0 (0 = known GPUs only)"),
}


@dataclass
class TrainConfig:
    """Every ``csattn train`` option (see ``csattn train --help`` for their meaning)."""

    # model
    init_from: str | None = None
    config_json: str | None = None
    mtp_layers: int | None = None
    dtype: str = "float32"
    backend: str = "auto"  # the kernels of every layer: auto | reference | triton
    deterministic: bool = False  # bitwise-reproducible steps (csattn.deterministic_mode + fixed-point kernels)
    recompute: str = "none"
    offload_block_inputs: bool = False  # with recompute block / full: block inputs in pinned host memory
    # data
    data: str = "synthetic"
    text_path: list[str] = field(default_factory=list)
    data_path: list[str] = field(default_factory=list)  # --data jsonl / parquet files
    text_field: str = "text"
    tokenizer: str | None = None  # local HF tokenizer directory (jsonl / parquet); else byte-level
    vocab_size: int = 256
    doc_min_len: int = 8
    doc_max_len: int = 96
    seq_len: int = 256
    pad_multiple: int = 1
    no_split: bool = False
    # optimization
    steps: int = 100
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    indexer_loss_coeff: float = 0.01
    mtp_loss_coeff: float = 0.3
    router_bias_rate: float = 1e-3
    max_bad_steps: int = 5  # consecutive non-finite (skipped) steps after which the run stops
    # parallelism / runtime
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: the ranks the other sizes leave
    cp: int = 1
    ep: int = 1
    cp_partition: str = "contiguous"
    dist_backend: str = "auto"  # auto = NCCL on GPUs, gloo on CPU
    dist_timeout: float = 600.0  # seconds a collective waits for the other ranks before this rank fails
    batch_seqs: int = 0  # packed sequences of seq_len rows per optimizer step; 0 = one per data replica
    device: str = "auto"
    seed: int = 0
    # checkpoints / logging
    output: str | None = None
    save_every: int = 0  # also a checkpoint every N steps (0 = no step interval)
    save_every_minutes: float | None = None  # also one when this many minutes passed; None = 30 without save_every
    keep_last: int | None = None  # keep only the newest N checkpoints under output (None = all)
    resume: str | None = None
    log_every: int = 10
    progress: bool = True
    peak_tflops: float = 0.0  # the GPU's dense matmul TFLOP/s for the MFU figure; 0 = known GPUs only
    metrics: str | None = None  # JSON lines, one per step; default <output>/metrics.jsonl with --output
    log_dir: str | None = None  # TensorBoard event files (rank 0) and loss.png
    export_hf: str = "final"  # HF-format model files in checkpoints: "final", "every" or "never"
    # fine-tuning (csattn.finetune): LoRA and which parameter groups train
    lora_rank: int = 0  # 0 = no LoRA
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str | None = None  # comma list of groups; None = attention,indexer,shared_experts,experts
    train_groups: str | None = None  # --train: only these groups train
    freeze_groups: str | None = None  # --freeze: these groups are frozen
    # the frozen base as --init-from's release checkpoint stores it (csattn.finetune.precision)
    base_precision: str = "bf16"  # "bf16" (dequantized), "fp8" / "w8a16" (routed experts held in FP8)
    fp8_linears: bool = False  # with fp8 / w8a16: the frozen dense linears stored in FP8 held in FP8 too
    allow_inexact_fp8: bool = False  # round MXFP4 blocks that FP8 cannot hold exactly instead of refusing

    def validate(self) -> None:
        """Raise :class:`UserError` naming the first option out of range (``RULES``) or inconsistent with another.
        Deterministic from the options: under torch.distributed every rank raises alike, before any collective."""
        for name, (ok, what) in RULES.items():
            value = getattr(self, name)
            if value is not None and not ok(value):
                raise UserError(f"--{name.replace('_', '-')} must be {what}, got {value!r}")
        if self.min_lr > self.lr:
            raise UserError(f"--min-lr {self.min_lr} is above --lr {self.lr}: the cosine decay ends at --min-lr, "
                            "so pass a --min-lr <= --lr")
        if self.doc_min_len > self.doc_max_len:
            raise UserError(f"--doc-min-len {self.doc_min_len} is above --doc-max-len {self.doc_max_len}")
        if self.seq_len % self.cp:
            raise UserError(f"--seq-len {self.seq_len} must be divisible by --cp {self.cp}: each rank of a CP group "
                            "takes an equal share of the rows")
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise UserError(f"--dp-shard must be >= 1 or -1 (the ranks the other sizes leave), got {self.dp_shard}")
        for name, choices in (("dist_backend", ("auto", "nccl", "gloo")), ("export_hf", ("final", "every", "never")),
                              ("dtype", ("float32", "bfloat16", "float64"))):
            if getattr(self, name) not in choices:
                raise UserError(f"--{name.replace('_', '-')} must be one of {', '.join(choices)}, got "
                                f"{getattr(self, name)!r}")
        for name in ("save_every", "save_every_minutes", "keep_last"):
            if getattr(self, name) and not self.output:
                raise UserError(f"--{name.replace('_', '-')} needs --output DIR: the directory the checkpoints go to")
        if self.config_json and not os.path.isfile(self.config_json):
            raise UserError(f"--config-json {self.config_json!r}: no such file (an HF config.json)")
        if self.init_from and not os.path.isdir(self.init_from):
            raise UserError(f"--init-from {self.init_from!r} is not a directory: pass a local HF-format checkpoint "
                            "directory (config.json + safetensors)")
        if self.init_from and (why := _damaged_init_from(self.init_from)):
            raise UserError(f"--init-from {self.init_from!r} is a damaged checkpoint: {why}")
        if self.data_path and self.data not in ("jsonl", "parquet"):
            raise UserError(f"--data-path is read by --data jsonl / parquet, not --data {self.data} (text files: "
                            "--data text --text-path)")
        if self.tokenizer and self.data not in ("jsonl", "parquet"):
            raise UserError(f"--tokenizer applies to --data jsonl / parquet, not --data {self.data}")
        try:  # --train / --freeze / --lora-* / --base-precision conflicts
            check_base_precision(self, Finetune.from_options(self).choice)
        except ValueError as e:
            raise UserError(str(e)) from None

    @property
    def save_minutes(self) -> float:
        """Minutes between time-based checkpoints (0 = none): ``save_every_minutes``, by default 30 when the run
        saves (``output``) without a step interval (``save_every``), so a killed run loses at most that."""
        if self.save_every_minutes is not None:
            return self.save_every_minutes
        return DEFAULT_SAVE_MINUTES if self.output and not self.save_every else 0.0
