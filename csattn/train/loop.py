"""The training loop on PyTorch's distributed engine: a named ``DeviceMesh`` (dp_replicate x dp_shard x cp, experts
over ep), the model built on the meta device and sharded with FSDP2 (``csattn.parallel``), packed batches, AdamW,
clipping, DCP checkpoints with exact resume on any mesh.

Data: a step reads ``batch_seqs`` packed sequences of ``seq_len`` rows (default: one per data replica); data replica
``d`` of ``dp`` packs sequences ``d * n .. (d + 1) * n - 1`` (``n = batch_seqs / dp``) back to back into its stream,
which its ``cp`` ranks split. The loss of the step is that of the whole global batch (see ``step.py``), so one
process reading all ``batch_seqs`` sequences computes the same step as any mesh, and a run resumes on another mesh
whose data replicas divide ``batch_seqs``.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig
from ..models.deepseek_v4.checkpoint import read_config
from ..ops.backend import resolve_backend
from ..ops.indexer_loss import IndexerLossAutoScaler
from ..parallel import (
    Meshes,
    ParallelDims,
    build_meshes,
    export_hf,
    load_hf_sharded,
    load_sharded,
    materialize,
    save_sharded,
)
from ..parallel import parallelize as parallelize_model
from ..report.flops import model_flops, peak_flops
from .checkpointing import (
    checkpoint_dir,
    compare_resume_config,
    mark_latest,
    prune_checkpoints,
    read_trainer_state,
    resolve_resume,
    write_trainer_state,
)
from .data import build_corpus, load_tokenizer
from .errors import TrainingStopped, UserError, user_errors
from .metrics import BOARD_TAGS, loss_history, metrics_file, plot_losses, summary_writer
from .packer import DocumentPacker, PackedBatch, concat_batches
from .step import train_step

__all__ = ["TrainConfig", "TrainResult", "train", "tiny_model_config", "loss_history", "build_model_config"]


RATE_WINDOW = 20  # steps over which tokens/s and MFU are reported


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
    attention_backend: str = "auto"
    deterministic: bool = False  # bitwise-reproducible steps (csattn.set_deterministic + fixed-point kernels)
    activation_checkpointing: bool = False  # the same as recompute="block"
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
    trust_checkpoint: bool = False  # also load old pickled trainer_state.pt files (they can run code)
    log_every: int = 10
    progress: bool = True
    peak_tflops: float = 0.0  # the GPU's dense matmul TFLOP/s for the MFU figure; 0 = known GPUs only
    metrics: str | None = None  # JSON lines, one per step; default <output>/metrics.jsonl with --output
    log_dir: str | None = None  # TensorBoard event files (rank 0) and loss.png
    export_hf: str = "final"  # HF-format model files in checkpoints: "final", "every" or "never"

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
        if self.data_path and self.data not in ("jsonl", "parquet"):
            raise UserError(f"--data-path is read by --data jsonl / parquet, not --data {self.data} (text files: "
                            "--data text --text-path)")
        if self.tokenizer and self.data not in ("jsonl", "parquet"):
            raise UserError(f"--tokenizer applies to --data jsonl / parquet, not --data {self.data}")

    @property
    def save_minutes(self) -> float:
        """Minutes between time-based checkpoints (0 = none): ``save_every_minutes``, by default 30 when the run
        saves (``output``) without a step interval (``save_every``), so a killed run loses at most that."""
        if self.save_every_minutes is not None:
            return self.save_every_minutes
        return DEFAULT_SAVE_MINUTES if self.output and not self.save_every else 0.0


@dataclass
class TrainResult:
    losses: list[float]  # total loss (LM + MTP) of each step run here, of the global batch
    lm_losses: list[float]
    indexer_losses: list[float]
    start_step: int
    model: DeepseekV4ForCausalLM  # sharded under a mesh: csattn.parallel.full_state_dict(model, meshes) gathers it
    tokens_per_second: float
    meshes: Meshes | None = None


def build_model_config(cfg: TrainConfig, tokenizer_vocab: int | None = None,
                       special_ids: dict[str, Any] | None = None) -> DeepseekV4ModelConfig:
    """The model to train; from scratch its vocabulary is the tokenizer's (``tokenizer_vocab``, loaded from
    ``cfg.tokenizer`` if not given) or ``cfg.vocab_size``. ``special_ids``: the tokenizer's BOS / EOS / PAD ids,
    which replace the config's (the data carries the tokenizer's)."""
    overrides: dict[str, Any] = dict(**(special_ids or {}), indexer_loss_coeff=cfg.indexer_loss_coeff,
                                     mtp_loss_coeff=cfg.mtp_loss_coeff,
                                     attention_backend=cfg.attention_backend,
                                     deterministic=cfg.deterministic,
                                     recompute="block" if cfg.activation_checkpointing else cfg.recompute,
                                     offload_block_inputs=cfg.offload_block_inputs)
    if cfg.mtp_layers is not None:
        overrides["num_nextn_predict_layers"] = cfg.mtp_layers
    if cfg.init_from:
        return DeepseekV4ModelConfig.from_hf(read_config(cfg.init_from), **overrides)
    if cfg.config_json:

        with open(cfg.config_json) as f:
            return DeepseekV4ModelConfig.from_hf(json.load(f), **overrides)
    if cfg.tokenizer and tokenizer_vocab is None:
        tokenizer_vocab = len(load_tokenizer(cfg.tokenizer))
    return tiny_model_config(tokenizer_vocab or cfg.vocab_size, **overrides)


def _lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(cfg.steps - cfg.warmup_steps, 1)
        frac = min((step - cfg.warmup_steps) / span, 1.0)
        floor = cfg.min_lr / cfg.lr if cfg.lr else 0.0
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))
    return f


def setup_distributed(cfg: TrainConfig) -> tuple[Meshes, torch.device]:
    """Initialize ``torch.distributed`` from torchrun's environment if needed (NCCL on GPUs, gloo on CPU) and build
    the meshes of ``--dp-replicate / --dp-shard / --cp / --ep`` (the same error on every rank if they do not fit)."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        # checked here: torch would fail later with an AttributeError deep in torch.cuda.set_device
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"--device cuda: {why} (torch {torch.__version__}); install the CUDA build of torch on "
                         "a GPU machine, or pass --device cpu (or --device auto)")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    # at startup, before the process group and the model: --attention-backend triton off CUDA (without Triton's
    # interpreter) would otherwise fail only at the first forward
    resolve_backend(cfg.attention_backend, "cuda" if use_cuda else "cpu")
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = cfg.dist_backend if cfg.dist_backend != "auto" else "nccl" if use_cuda else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.dist_timeout))
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("cpu")
    if use_cuda:  # ranks beyond the GPU count share GPUs (gloo only: NCCL takes one rank per GPU)
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
    dims = ParallelDims(dp_replicate=cfg.dp_replicate, dp_shard=cfg.dp_shard, cp=cfg.cp, ep=cfg.ep)
    return build_meshes(dims, device.type), device


def build_model(cfg: TrainConfig, model_cfg: DeepseekV4ModelConfig, meshes: Meshes,
                device: torch.device) -> tuple[DeepseekV4ForCausalLM, Any]:
    """The model on the meta device, sharded over ``meshes``, then given storage and weights one unit at a time
    (fresh from ``--seed``, or ``--init-from``'s HF checkpoint); returns it and its ``ContextParallel``."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(model_cfg)
    dtype = getattr(torch, cfg.dtype)
    sharded = meshes.distributed
    # FSDP needs one dtype per unit: sharded, the storage stays fp32 (or fp64) and bf16 is FSDP's compute dtype
    param_dtype = dtype if sharded and dtype == torch.bfloat16 else None
    if not sharded and dtype != torch.float32:
        model.to_training_dtype(dtype)
    elif dtype == torch.float64:
        model.to(torch.float64)
    # gradients reduced in fp32, or in the storage dtype when that is wider
    reduce_dtype = torch.promote_types(dtype, torch.float32)
    cp = parallelize_model(model, meshes, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                           cp_partition=cfg.cp_partition)
    if not cfg.init_from:
        return materialize(model, device, cfg.seed), cp
    n_mtp = model_cfg.num_nextn_predict_layers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with user_errors():  # missing or misshaped tensors of the --init-from directory
            load_hf_sharded(model, cfg.init_from, device, seed=cfg.seed)
    if meshes.rank == 0:
        for message in dict.fromkeys(str(w.message) for w in caught):
            fresh = "no mtp.* tensors" in message
            warnings.warn(f"--init-from {cfg.init_from}: no mtp.* tensors; the {n_mtp} MTP block(s) start from "
                          "fresh weights (pass --mtp-layers 0 to train without MTP)" if fresh else message,
                          stacklevel=3)
    return model, cp


def _optimizer(model: DeepseekV4ForCausalLM, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    # weight decay on matrices only: not on norms, sinks, position / router biases, nor the mHC weights
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        mhc = any(part in ("attn_hc", "ffn_hc", "hc_head") for part in name.split("."))
        (decay if p.dim() >= 2 and not mhc else no_decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
        fused=device.type == "cuda")  # one kernel for all parameters on the GPU (the CPU keeps the default path)


class BatchReader:
    """This data replica's share of each global batch: sequences ``shards`` of ``batch_seqs``, packed back to back.

    ``state_dict`` is the position of every one of ``batch_seqs`` sequence streams (gathered from the replicas), so
    a run on another mesh picks up the streams its replicas now read."""

    def __init__(self, cfg: TrainConfig, model_cfg: DeepseekV4ModelConfig, tokenizer: Any, label_depth: int,
                 batch_seqs: int, shards: range) -> None:
        self.batch_seqs, self.shards = batch_seqs, shards
        self.packers = [DocumentPacker(
            build_corpus(cfg.data, model_cfg.vocab_size, cfg.seed, cfg.text_path, cfg.doc_min_len, cfg.doc_max_len,
                         data_paths=cfg.data_path, text_field=cfg.text_field, tokenizer=tokenizer),
            cfg.seq_len, cfg.pad_multiple, label_depth=label_depth, shard=s, num_shards=batch_seqs,
            split=not cfg.no_split) for s in shards]

    def __next__(self) -> PackedBatch:
        return concat_batches([next(p) for p in self.packers])

    def state_dict(self) -> dict[int, Any]:
        return {s: p.state_dict() for s, p in zip(self.shards, self.packers)}

    def load_state_dict(self, states: list[Any]) -> None:
        for s, p in zip(self.shards, self.packers):
            p.load_state_dict(states[s])


def train(cfg: TrainConfig) -> TrainResult:
    """Run ``cfg.steps`` optimizer steps (counting any resumed ones). Works in one process or under torchrun.

    Raises :class:`UserError` on a mistake in the options, checkpoints or data files, and :class:`TrainingStopped`
    after ``max_bad_steps`` non-finite steps in a row or when the weights to save are not finite.

    ``cfg.deterministic`` turns torch's deterministic mode on for the run (:func:`csattn.set_deterministic`, before
    any CUDA work) and gives the model's kernels fixed-point sums: two runs, or a run killed and resumed, give the
    same bits on the same GPU and software. The process's previous mode is restored at the end."""
    cfg.validate()
    if not cfg.deterministic:
        return _train(cfg)
    from ..deterministic import set_deterministic

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    set_deterministic(True)
    try:
        return _train(cfg)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


def _train(cfg: TrainConfig) -> TrainResult:
    with user_errors():
        meshes, device = setup_distributed(cfg)
    dims, rank = meshes.dims, meshes.rank
    if cfg.offload_block_inputs and device.type == "cuda" and rank == 0 and \
            "expandable_segments:True" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        # a hint only: the allocator setting is PyTorch's own and must be set before CUDA starts
        print("note: --offload-block-inputs is for the longest sequences; there PyTorch's allocator may fail on "
              "fragments (tens of GiB reserved but unallocated): run with "
              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", flush=True)
    with user_errors():  # the checkpoint to resume, its options against these, the tokenizer
        resume = _resume_path(cfg, rank)
        state = read_trainer_state(resume, trust_checkpoint=cfg.trust_checkpoint) if resume else None
        if state is not None:
            # raises on other data options, before the weights (another --tokenizer also changes the vocab shape)
            notes = compare_resume_config(resume, state.get("train_config"), asdict(cfg))
            if rank == 0:
                for note in notes:
                    warnings.warn(note, stacklevel=2)
        batch_seqs = int(state.get("batch_seqs", state.get("dp", 1))) if state else (cfg.batch_seqs or dims.dp)
        if batch_seqs % dims.dp:
            saved = " (the checkpoint's)" if state else ""
            raise ValueError(f"{batch_seqs} packed sequences per step{saved} do not split over {dims.dp} data "
                             f"replicas (--dp-replicate x --dp-shard): pick sizes whose data replicas divide "
                             f"{batch_seqs}")
        tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
        model_cfg = build_model_config(cfg, len(tokenizer) if tokenizer is not None else None,
                                       special_ids=_special_ids(tokenizer))
    model, cp = build_model(cfg, model_cfg, meshes, device)
    per = batch_seqs // dims.dp
    dp_rank = meshes.coords["dp"]
    with user_errors():  # the data files
        reader = BatchReader(cfg, model_cfg, tokenizer, 1 + len(model.mtp), batch_seqs,
                             range(dp_rank * per, (dp_rank + 1) * per))
    optimizer = _optimizer(model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))

    start = 0
    if state is not None:
        with user_errors():  # a checkpoint of another model config names the tensor
            load_sharded(resume, model, optimizer, meshes)
        if rank == 0:
            print(f"resuming from {resume} at step {int(state['step'])}", flush=True)
        scheduler.load_state_dict(state["scheduler"])
        with user_errors():
            reader.load_state_dict(state["packers"])
        rngs = state["rng"] if isinstance(state["rng"], list) else [state["rng"]]
        torch.set_rng_state(rngs[rank] if len(rngs) == dims.world else rngs[0])
        start = int(state["step"])

    losses, lm_losses, idx_losses = [], [], []
    bar = None
    if cfg.progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc="train", dynamic_ncols=True)
    peak = peak_flops(device, cfg.peak_tflops)
    log = metrics_file(cfg, rank, start if state is not None else None)
    board = summary_writer(cfg, rank, start)
    tokens, t0 = 0, time.perf_counter()
    # throughput over the last steps (the first steps also compile kernels: a rate since the start would
    # understate the steady state for hundreds of steps)
    recent: deque[tuple[float, int, float]] = deque([(t0, 0, 0.0)], maxlen=RATE_WINDOW + 1)
    clock = _SaveClock(cfg.save_minutes if cfg.output else 0.0, meshes, device)
    bad_run = 0  # non-finite steps in a row
    with user_errors():  # the data files
        batch = next(reader) if start < cfg.steps else None
    try:
        for step in range(start, cfg.steps):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            finish = train_step(model, batch, cp, meshes, optimizer, cfg.grad_clip, cfg.router_bias_rate, device)
            # the next batch is built on the host while the device runs this step; a checkpoint of this step holds
            # the readers' position before it
            consumed = reader.state_dict()
            with user_errors():
                upcoming = next(reader) if step + 1 < cfg.steps else None
            metrics = finish()
            # a skipped (non-finite) step advances the schedule too: the LR stays a function of the step number,
            # so --steps ends the decay where it says and a resumed run continues the same curve
            scheduler.step()
            losses.append(metrics["loss"])
            lm_losses.append(metrics["lm_loss"])
            idx_losses.append(metrics["indexer_loss"])
            step_tokens = batch.num_tokens * dims.dp  # replicas hold the same number of rows, tokens may differ
            tokens += step_tokens
            step_flops = 0.0
            if peak:
                f = model_flops(model_cfg, batch.packed.cu_seqlens)
                step_flops = (f["fwd"] + f["bwd"]) * dims.dp
            now = time.perf_counter()
            step_time = now - recent[-1][0]
            recent.append((now, step_tokens, step_flops))
            window = max(now - recent[0][0], 1e-9)
            steps = list(recent)[1:]  # recent[0] only marks the window's start time
            tps = sum(r[1] for r in steps) / window
            mfu_value = sum(r[2] for r in steps) / window / (peak * dims.world) if peak else None
            mfu = f"{mfu_value:.1%}" if peak else None
            if log is not None or board is not None:
                rec = {"step": step + 1, **metrics, "lr": scheduler.get_last_lr()[0], "tokens": step_tokens,
                       "tokens_per_s": tps, "mfu": mfu_value, "step_time": step_time, "time": time.time()}
                if device.type == "cuda":
                    rec["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            if log is not None:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            if board is not None:
                for key, value in rec.items():
                    if key in BOARD_TAGS and value is not None:
                        board.add_scalar(BOARD_TAGS[key], value, step + 1)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", idx=f"{metrics['indexer_loss']:.3g}",
                                tok_s=f"{tps:.0f}", **({"mfu": mfu} if mfu else {}))
            if rank == 0 and (step + 1) % cfg.log_every == 0:
                _say(bar, f"step {step + 1}: loss {metrics['loss']:.4f} lm {metrics['lm_loss']:.4f} "
                     f"indexer {metrics['indexer_loss']:.4g} lr {scheduler.get_last_lr()[0]:.3g} tok/s {tps:.0f}"
                     + (f" MFU {mfu}" if mfu else ""))
            bad_run = _check_finite_step(cfg, step + 1, metrics["nonfinite"], bad_run, rank, bar)
            # with --output the final step is always saved; --save-every and --save-every-minutes add the
            # intermediate checkpoints (the clock is asked on every rank alike: it is a collective)
            last = step + 1 == cfg.steps
            if cfg.output and (last or (cfg.save_every and (step + 1) % cfg.save_every == 0) or clock.due()):
                _save(cfg, step + 1, model, optimizer, scheduler, consumed, meshes, batch_seqs, last, tokenizer)
                clock.restart()
            batch = upcoming
    finally:
        IndexerLossAutoScaler.main_loss_backward_scale = None
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()
        if board is not None:
            board.close()
    if rank == 0 and (cfg.log_dir or cfg.output) and losses:
        plot_losses(cfg, start, losses, lm_losses, idx_losses)
    return TrainResult(losses, lm_losses, idx_losses, start, model, tokens / max(time.perf_counter() - t0, 1e-9),
                       meshes)


def _say(bar: Any, line: str) -> None:
    """One log line (rank 0), above the progress bar when there is one."""
    if bar:
        bar.write(line)
    else:
        print(line, flush=True)


def _resume_path(cfg: TrainConfig, rank: int) -> str | None:
    """The checkpoint to resume (None: start at step 0, said aloud when ``--resume auto`` found none)."""
    if not cfg.resume:
        return None
    resume = resolve_resume(cfg.resume, cfg.output)
    if resume is None and rank == 0:
        print(f"--resume auto: no checkpoint under {cfg.output}: starting from step 0", flush=True)
    return resume


def _special_ids(tokenizer: Any) -> dict[str, Any] | None:
    """The tokenizer's BOS / EOS / PAD ids for the model config (so the saved config.json agrees with the tokenizer
    saved next to it, and HF ``generate`` stops at its EOS); None without a tokenizer."""
    if tokenizer is None:
        return None
    return {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad")}


def _check_finite_step(cfg: TrainConfig, step: int, nonfinite: str | None, bad_run: int, rank: int,
                       bar: Any) -> int:
    """Count non-finite (skipped) steps in a row: a warning line for each (rank 0), :class:`TrainingStopped` at
    ``max_bad_steps``. Returns the new count. Every rank got the same all-reduced
    verdict from the step, so every rank stops alike."""
    if nonfinite is None:
        return 0
    bad_run += 1
    if rank == 0:
        _say(bar, f"warning: step {step}: non-finite {nonfinite}: step skipped (weights, optimizer state and router "
                  f"biases unchanged; {bad_run} in a row, the run stops at --max-bad-steps {cfg.max_bad_steps})")
    if bad_run >= cfg.max_bad_steps:
        where = f"the latest checkpoint under {cfg.output}" if cfg.output else "a checkpoint"
        raise TrainingStopped(
            f"steps {step - bad_run + 1}..{step}: {bad_run} non-finite steps in a row (--max-bad-steps "
            f"{cfg.max_bad_steps}; the last one: non-finite {nonfinite}); the run stopped with the weights of step "
            f"{step - bad_run}. Resume from {where} (--resume auto) with a lower --lr, more --warmup-steps or a "
            "--grad-clip; a non-finite loss from the first step on points at the data or the --init-from weights")
    return bad_run


class _SaveClock:
    """Time-based checkpoints: ``due()`` when ``minutes`` have passed since the start or the last save on any rank
    (a MAX all-reduce of the verdict, so every rank saves at the same step whatever its clock says)."""

    def __init__(self, minutes: float, meshes: Meshes, device: torch.device) -> None:
        self.seconds, self.meshes, self.device = minutes * 60, meshes, device
        self.restart()

    def restart(self) -> None:
        self.since = time.monotonic()

    def due(self) -> bool:
        if not self.seconds:
            return False
        late = torch.tensor([float(time.monotonic() - self.since >= self.seconds)], device=self.device)
        if self.meshes.distributed:
            dist.all_reduce(late, op=dist.ReduceOp.MAX)
        return bool(late.item())


def _weights_finite(model: DeepseekV4ForCausalLM, meshes: Meshes) -> bool:
    """Whether every weight (parameters and floating buffers: router biases) is finite on every rank: one MAX
    all-reduce of this rank's verdict on its shards, so every rank decides alike."""
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in (*model.parameters(), *model.buffers())]
    flags = [~torch.isfinite(t).all() for t in local if t.is_floating_point() and t.numel()]
    bad = torch.stack(flags).any().float().reshape(1) if flags else torch.zeros(1)
    if meshes.distributed:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bad.item()


def _gather(obj: Any, meshes: Meshes) -> list[Any]:
    if not meshes.distributed:
        return [obj]
    everyone: list[Any] = [None] * meshes.dims.world
    dist.all_gather_object(everyone, obj)
    return everyone


def _save(cfg: TrainConfig, step: int, model: DeepseekV4ForCausalLM, optimizer: torch.optim.Optimizer,
          scheduler: Any, reader_state: dict[int, Any], meshes: Meshes, batch_seqs: int, last: bool,
          tokenizer: Any = None) -> None:
    """Checkpoint ``step`` (a collective): DCP shards of the model and optimizer, the trainer state (rank 0), the
    HF-format model files when ``--export-hf`` asks, the tokenizer's files, and ``latest`` once everything is
    written; then ``--keep-last`` prunes the older ones. Refuses non-finite weights before writing anything."""
    path = checkpoint_dir(cfg.output, step)
    if not _weights_finite(model, meshes):
        # a checkpoint of them would only resume into the same failure, and --keep-last would prune good ones
        raise TrainingStopped(
            f"step {step}: the model's weights hold NaN or inf values: refusing to save {path}; the checkpoints "
            f"already under {cfg.output} are kept. Resume from the latest (--resume auto) with a lower --lr, more "
            "--warmup-steps or a --grad-clip")
    save_sharded(path, model, optimizer, meshes)
    packers: list[Any] = [None] * batch_seqs
    for states in _gather(reader_state, meshes):
        for s, st in states.items():
            packers[s] = st
    rngs = _gather(torch.get_rng_state(), meshes)
    if cfg.export_hf == "every" or (cfg.export_hf == "final" and last):
        export_hf(model, path, meshes)
    if meshes.rank == 0:
        if tokenizer is not None:  # the checkpoint decodes and generates on its own (config.json has its ids)
            tokenizer.save_pretrained(path)
        write_trainer_state(path, step, {
            "scheduler": scheduler.state_dict(), "packers": packers, "rng": rngs, "batch_seqs": batch_seqs,
            "mesh": asdict(meshes.dims), "train_config": asdict(cfg), "model_training": model.config.training_dict(),
        })
    if meshes.distributed:
        dist.barrier()  # every rank's shards are on disk before latest names the checkpoint
    if meshes.rank == 0:
        mark_latest(cfg.output, path)
        from tqdm import tqdm

        tqdm.write(f"saved checkpoint {path}")  # above any progress bar
        if cfg.keep_last:  # only now that the new checkpoint is complete and named latest
            for old in prune_checkpoints(cfg.output, cfg.keep_last):
                tqdm.write(f"removed checkpoint {old} (--keep-last {cfg.keep_last})")
    if meshes.distributed:
        dist.barrier()
