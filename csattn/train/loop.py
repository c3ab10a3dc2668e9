"""The training loop: packed batches, data parallel x context parallel, AdamW, clipping, checkpoints.

Ranks: ``world = dp * cp``; ranks ``[g*cp, (g+1)*cp)`` form context-parallel group ``g`` (data replica
``g``). Every rank of a replica packs the same batch and keeps its own rows (``cp.shard``). Each replica's
loss is its summed cross entropy over the global label count, so the CP ranks' gradients add up to the
replica gradient; gradients are then all-reduced over the world and divided by ``dp`` (mean over replicas).
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig
from ..models.deepseek_v4.checkpoint import read_config
from ..report.flops import model_flops
from .checkpointing import (
    compare_resume_config,
    load_checkpoint_weights,
    prune_checkpoints,
    read_trainer_state,
    resolve_resume,
    save_checkpoint,
)
from .data import build_corpus, load_tokenizer
from .packer import DocumentPacker, PackedBatch

__all__ = ["TrainConfig", "TrainResult", "train", "tiny_model_config", "Topology"]


RATE_WINDOW = 20  # steps over which tokens/s and MFU are reported


def tiny_model_config(vocab_size: int = 256, **overrides: Any) -> DeepseekV4ModelConfig:
    """A CPU-sized model that still has every part: W, CSA and HCA layers, hash and learned MoE, MTP."""
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


@dataclass
class TrainConfig:
    """Every ``csattn train`` option (see ``csattn train --help`` for their meaning)."""

    # model
    init_from: str | None = None
    config_json: str | None = None
    mtp_layers: int | None = None
    dtype: str = "float32"
    attention_backend: str = "auto"
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
    # parallelism / runtime
    cp: int = 1
    cp_partition: str = "contiguous"
    device: str = "auto"
    seed: int = 0
    # checkpoints / logging
    output: str | None = None
    save_every: int = 0
    keep_last: int = 0  # keep only the newest N checkpoints under output (0 = all)
    resume: str | None = None
    trust_checkpoint: bool = False  # also load old pickled trainer_state.pt files (they can run code)
    log_every: int = 10
    progress: bool = True
    peak_tflops: float = 0.0  # the GPU's dense matmul TFLOP/s for the MFU figure; 0 = known GPUs only
    metrics: str | None = None  # JSON lines, one per step; default <output>/metrics.jsonl with --output
    log_dir: str | None = None  # TensorBoard event files (rank 0) and loss.png

    def validate(self) -> None:
        for name in ("steps", "seq_len", "pad_multiple", "cp", "log_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len % self.cp:
            raise ValueError(f"seq_len ({self.seq_len}) must be divisible by cp ({self.cp})")
        if self.dtype not in ("float32", "bfloat16", "float64"):
            raise ValueError(f"dtype must be float32, bfloat16 or float64, got {self.dtype!r}")
        if self.save_every and not self.output:
            raise ValueError("--save-every (save_every) needs --output DIR: the directory the checkpoints go to")
        if self.warmup_steps < 0 or self.grad_clip < 0:
            raise ValueError("warmup_steps and grad_clip must be >= 0")
        if self.data_path and self.data not in ("jsonl", "parquet"):
            raise ValueError(f"--data-path is read by --data jsonl / parquet, not --data {self.data} (text files: "
                             "--data text --text-path)")
        if self.tokenizer and self.data not in ("jsonl", "parquet"):
            raise ValueError(f"--tokenizer applies to --data jsonl / parquet, not --data {self.data}")


@dataclass
class TrainResult:
    losses: list[float]  # total loss (LM + MTP) of each step run here, mean over replicas
    lm_losses: list[float]
    indexer_losses: list[float]
    start_step: int
    model: DeepseekV4ForCausalLM
    tokens_per_second: float


@dataclass
class Topology:
    """Where this rank sits: ``dp_rank`` of ``dp`` replicas, ``cp_rank`` of ``cp`` ranks in its replica."""

    rank: int
    world: int
    cp: int
    cp_group: Any = None

    @property
    def dp(self) -> int:
        return self.world // self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp


def setup_distributed(cfg: TrainConfig) -> tuple[Topology, torch.device]:
    """Initialize ``torch.distributed`` from torchrun's environment if needed (NCCL on GPUs, gloo on CPU)
    and build the CP groups."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        # checked here: torch would fail later with an AttributeError deep in torch.cuda.set_device
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"--device cuda: {why} (torch {torch.__version__}); install the CUDA build of torch on "
                         "a GPU machine, or pass --device cpu (or --device auto)")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized() and world_env > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % cfg.cp:
        if world == 1:  # the usual mistake: CP needs one process per rank, started by torchrun
            raise ValueError(f"--cp {cfg.cp} needs {cfg.cp} processes (one per context-parallel rank) but this is "
                             f"a single process: run `torchrun --nproc-per-node {cfg.cp} -m csattn train --cp "
                             f"{cfg.cp} ...` (or --cp 1 here)")
        raise ValueError(f"world size {world} is not divisible by --cp {cfg.cp}: start a multiple of {cfg.cp} "
                         "processes (torchrun --nproc-per-node) or pick a --cp that divides the world size")
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1))))
        torch.cuda.set_device(device)
    topo = Topology(rank, world, cfg.cp)
    if cfg.cp > 1:
        if cfg.cp == world:
            topo.cp_group = dist.group.WORLD
        else:  # every rank must create every group
            for g in range(world // cfg.cp):
                group = dist.new_group(list(range(g * cfg.cp, (g + 1) * cfg.cp)))
                if g == topo.dp_rank:
                    topo.cp_group = group
    return topo, device


def build_model_config(cfg: TrainConfig, tokenizer_vocab: int | None = None) -> DeepseekV4ModelConfig:
    """The model to train; from scratch its vocabulary is the tokenizer's (``tokenizer_vocab``, loaded from
    ``cfg.tokenizer`` if not given) or ``cfg.vocab_size``."""
    overrides: dict[str, Any] = dict(indexer_loss_coeff=cfg.indexer_loss_coeff, mtp_loss_coeff=cfg.mtp_loss_coeff,
                                     attention_backend=cfg.attention_backend,
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


def _all_reduce_grads(params: list[torch.nn.Parameter], topo: Topology) -> None:
    """Sum partial gradients over the world (CP shards add up, replicas too), then average the replicas."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if topo.world > 1:
        dtype = max((torch.promote_types(g.dtype, torch.float32) for g in grads), key=lambda d: d.itemsize)
        flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
        dist.all_reduce(flat)
        flat /= topo.dp
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
            offset += n
    else:
        for p, g in zip(params, grads):
            p.grad = g


def train_step(model: DeepseekV4ForCausalLM, batch: PackedBatch, cp: Any, topo: Topology,
               optimizer: torch.optim.Optimizer, cfg: TrainConfig,
               device: torch.device) -> Callable[[], dict[str, float]]:
    """One optimizer step on one packed batch, launched: returns ``finish()``, which waits for the step and gives
    its replica-mean metrics (identical on every rank). Between the two the host is free while the device runs
    the step's tail (the loop builds the next batch there)."""
    packed = batch.packed
    ids, labels = batch.input_ids, batch.labels
    counts = (labels != -100).sum(dim=1).to(torch.float32)  # global label counts: the loss denominators
    if cp is not None:
        packed = type(packed)(cu_seqlens=packed.cu_seqlens.to(device), cu_seqlens_padded=packed.cu_seqlens_padded
                              .to(device), max_seqlen=packed.max_seqlen)
        ids = cp.shard(ids.to(device), packed)
        labels = cp.shard(labels.to(device).t().contiguous(), packed).t()
    else:
        packed = type(packed)(cu_seqlens=packed.cu_seqlens.to(device),
                              cu_seqlens_padded=packed.cu_seqlens_padded.to(device), max_seqlen=packed.max_seqlen)
        ids, labels = ids.to(device), labels.to(device)
    optimizer.zero_grad(set_to_none=True)
    out = model(ids, packed=packed, cp=cp, labels=labels[0], mtp_labels=labels[1:] if len(model.mtp) else None,
                label_counts=counts.to(device), return_logits=False)
    out.loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    _all_reduce_grads(params, topo)
    # the global norm (gradients are already all-reduced, so every rank has the same), before clipping
    if cfg.grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    else:
        grad_norm = torch.linalg.vector_norm(torch.stack([  # as clip_grad_norm_ computes it, in >= fp32
            torch.linalg.vector_norm(p.grad, dtype=torch.promote_types(p.grad.dtype, torch.float32)).double()
            for p in params]))
    optimizer.step()
    # load balancing of the learned routers, from the loads of every rank
    loads = model.expert_loads()
    if loads and cfg.router_bias_rate > 0:
        stacked = torch.stack([x.to(torch.float32) for x in loads])
        if topo.world > 1:
            dist.all_reduce(stacked)
        model.update_router_biases(list(stacked), cfg.router_bias_rate)
    zero = torch.zeros((), device=device).double()
    metrics = torch.stack([
        out.loss.detach().double(), out.lm_loss.double(),
        out.indexer_loss.double() if out.indexer_loss is not None else zero,
        torch.stack(out.mtp_losses).double().mean() if out.mtp_losses else zero,  # the mean the loss weights
        grad_norm.detach().double().reshape(()).to(device),
    ]).to(device)
    has_mtp = bool(out.mtp_losses)

    def finish() -> dict[str, float]:
        if topo.world > 1:  # every rank calls finish once per step, in step order: the collectives pair up
            dist.all_reduce(metrics[:4])
            metrics[:4] /= topo.dp
        loss, lm, idx, mtp, norm = metrics.tolist()
        return {"loss": loss, "lm_loss": lm, "indexer_loss": idx, "mtp_loss": mtp if has_mtp else None,
                "grad_norm": norm}

    return finish


def train(cfg: TrainConfig) -> TrainResult:
    """Run ``cfg.steps`` optimizer steps (counting any resumed ones). Works in one process or under torchrun."""
    cfg.validate()
    topo, device = setup_distributed(cfg)
    if cfg.offload_block_inputs and device.type == "cuda" and topo.rank == 0 and \
            "expandable_segments:True" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        # a hint only: the allocator setting is PyTorch's own and must be set before CUDA starts
        print("note: --offload-block-inputs is for the longest sequences; there PyTorch's allocator may fail on "
              "fragments (tens of GiB reserved but unallocated): run with "
              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", flush=True)
    cp = None
    if cfg.cp > 1:
        from ..cp import ContextParallel

        cp = ContextParallel(topo.cp_group, partition=cfg.cp_partition)
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    model_cfg = build_model_config(cfg, len(tokenizer) if tokenizer is not None else None)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    if cfg.init_from:
        from ..models.deepseek_v4.checkpoint import load_pretrained

        # any HF-format directory, the released FP8 / MXFP4 checkpoints too (dequantized tensor by tensor); MTP
        # blocks the run asks for start from fresh weights when the checkpoint holds none
        fields = {k: getattr(model_cfg, k) for k in model_cfg.training_dict()}
        n_mtp = model_cfg.num_nextn_predict_layers
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = load_pretrained(cfg.init_from, mtp=n_mtp > 0, num_nextn_predict_layers=n_mtp, **fields)
        for w in caught:
            if topo.rank == 0:
                fresh = "no mtp.* tensors" in str(w.message)
                warnings.warn(f"--init-from {cfg.init_from}: no mtp.* tensors; the {n_mtp} MTP block(s) start from "
                              "fresh weights (pass --mtp-layers 0 to train without MTP)" if fresh else w.message,
                              stacklevel=2)
    else:
        model = DeepseekV4ForCausalLM(model_cfg)
    dtype = getattr(torch, cfg.dtype)
    if dtype != torch.float32:
        model.to_training_dtype(dtype)
    model.to(device)
    corpus = build_corpus(cfg.data, model_cfg.vocab_size, cfg.seed, cfg.text_path, cfg.doc_min_len, cfg.doc_max_len,
                          data_paths=cfg.data_path, text_field=cfg.text_field, tokenizer=tokenizer)
    packer = DocumentPacker(corpus, cfg.seq_len, cfg.pad_multiple, label_depth=1 + len(model.mtp),
                            shard=topo.dp_rank, num_shards=topo.dp, split=not cfg.no_split)
    # weight decay on matrices only: not on norms, sinks, position / router biases, nor the mHC weights
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        mhc = any(part in ("attn_hc", "ffn_hc", "hc_head") for part in name.split("."))
        (decay if p.dim() >= 2 and not mhc else no_decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
        fused=device.type == "cuda")  # one kernel for all parameters on the GPU (the CPU keeps the default path)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))

    start = 0
    resume = resolve_resume(cfg.resume, cfg.output) if cfg.resume else None
    if resume is not None:
        state = read_trainer_state(resume, trust_checkpoint=cfg.trust_checkpoint)
        # raises on other data options, before the weights (another --tokenizer also changes the vocab shape)
        notes = compare_resume_config(resume, state.get("train_config"), asdict(cfg))
        load_checkpoint_weights(resume, model)
        if topo.rank == 0:
            for note in notes:
                warnings.warn(note, stacklevel=2)
            print(f"resuming from {resume} at step {int(state['step'])}", flush=True)
        if state["dp"] != topo.dp:
            raise ValueError(f"checkpoint {resume} was written with {state['dp']} data-parallel replicas; "
                             f"this run has {topo.dp} (the data order depends on it)")
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        packer.load_state_dict(state["packers"][topo.dp_rank])
        torch.set_rng_state(state["rng"])
        start = int(state["step"])

    losses, lm_losses, idx_losses = [], [], []
    bar = None
    if cfg.progress and topo.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc="train", dynamic_ncols=True)
    peak = _peak_flops(cfg, device)
    log = _metrics_file(cfg, topo)
    board = _summary_writer(cfg, topo, start)
    tokens, t0 = 0, time.perf_counter()
    # throughput over the last steps (the first steps also compile kernels: a rate since the start would
    # understate the steady state for hundreds of steps)
    recent: deque[tuple[float, int, float]] = deque([(t0, 0, 0.0)], maxlen=RATE_WINDOW + 1)
    batch = next(packer) if start < cfg.steps else None
    for step in range(start, cfg.steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        finish = train_step(model, batch, cp, topo, optimizer, cfg, device)
        # the next batch is built on the host while the device runs this step; a checkpoint of this step holds
        # the packer's position before it
        consumed = packer.state_dict()
        upcoming = next(packer) if step + 1 < cfg.steps else None
        metrics = finish()
        scheduler.step()
        losses.append(metrics["loss"])
        lm_losses.append(metrics["lm_loss"])
        idx_losses.append(metrics["indexer_loss"])
        tokens += batch.num_tokens * topo.dp
        step_flops = 0.0
        if peak:
            f = model_flops(model_cfg, batch.packed.cu_seqlens)
            step_flops = (f["fwd"] + f["bwd"]) * topo.dp
        now = time.perf_counter()
        step_time = now - recent[-1][0]
        recent.append((now, batch.num_tokens * topo.dp, step_flops))
        window = max(now - recent[0][0], 1e-9)
        steps = list(recent)[1:]  # recent[0] only marks the window's start time
        tps = sum(r[1] for r in steps) / window
        mfu_value = sum(r[2] for r in steps) / window / (peak * topo.world) if peak else None
        mfu = f"{mfu_value:.1%}" if peak else None
        if log is not None or board is not None:
            rec = {"step": step + 1, **metrics, "lr": scheduler.get_last_lr()[0], "tokens": batch.num_tokens * topo.dp,
                   "tokens_per_s": tps, "mfu": mfu_value, "step_time": step_time, "time": time.time()}
            if device.type == "cuda":
                rec["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if log is not None:
            log.write(json.dumps(rec) + "\n")
            log.flush()
        if board is not None:
            for key, value in rec.items():
                if key in _BOARD_TAGS and value is not None:
                    board.add_scalar(_BOARD_TAGS[key], value, step + 1)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", idx=f"{metrics['indexer_loss']:.3g}", tok_s=f"{tps:.0f}",
                            **({"mfu": mfu} if mfu else {}))
        if topo.rank == 0 and (step + 1) % cfg.log_every == 0:
            line = (f"step {step + 1}: loss {metrics['loss']:.4f} lm {metrics['lm_loss']:.4f} "
                    f"indexer {metrics['indexer_loss']:.4g} lr {scheduler.get_last_lr()[0]:.3g} tok/s {tps:.0f}"
                    + (f" MFU {mfu}" if mfu else ""))
            if bar is not None:
                bar.write(line)
            else:
                print(line, flush=True)
        # with --output the final step is always saved; --save-every adds the intermediate checkpoints
        if cfg.output and ((cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps):
            _save(cfg, step + 1, model, optimizer, scheduler, consumed, topo)
        batch = upcoming
    if bar is not None:
        bar.close()
    if log is not None:
        log.close()
    if board is not None:
        board.close()
    if topo.rank == 0 and (cfg.log_dir or cfg.output) and losses:
        _plot_losses(cfg, start, losses, lm_losses, idx_losses)
    return TrainResult(losses, lm_losses, idx_losses, start, model, tokens / max(time.perf_counter() - t0, 1e-9))


def _metrics_file(cfg: TrainConfig, topo: Topology) -> Any:
    """Rank 0's JSON-lines metrics file (appended to, so a resumed run continues it), or None."""
    path = cfg.metrics or (os.path.join(cfg.output, "metrics.jsonl") if cfg.output else None)
    if path is None or topo.rank != 0:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return open(path, "a")


# TensorBoard tag of each per-step metrics record field
_BOARD_TAGS = {"loss": "loss/total", "lm_loss": "loss/lm", "mtp_loss": "loss/mtp", "indexer_loss": "loss/indexer",
               "lr": "optim/lr", "grad_norm": "optim/grad_norm", "tokens_per_s": "perf/tokens_per_s",
               "mfu": "perf/mfu", "peak_gib": "perf/peak_gib"}


def _summary_writer(cfg: TrainConfig, topo: Topology, start: int) -> Any:
    """Rank 0's TensorBoard writer for ``--log-dir``, or None."""
    if not cfg.log_dir or topo.rank != 0:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError("--log-dir needs the tensorboard package: pip install 'csattn[data]' (or tensorboard)") from e
    # resumed: TensorBoard drops what earlier event files hold from step start + 1 on (the steps are run again)
    return SummaryWriter(cfg.log_dir, purge_step=start + 1 if start else None, flush_secs=30)


def _last_per_step(path: str) -> dict[int, dict[str, Any]]:
    """The metrics file's records by step; a step logged again (resumed after it) keeps its last record."""
    records: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                records[int(rec["step"])] = rec
    return records


def loss_history(cfg: TrainConfig, start: int, losses: list[float], lm: list[float],
                 idx: list[float]) -> tuple[list[int], dict[str, list[float]]]:
    """Steps and losses of every step so far: from the metrics file when there is one (it holds the steps of
    earlier runs this one resumed; a step run again keeps its last value), else this run's own."""
    path = cfg.metrics or (os.path.join(cfg.output, "metrics.jsonl") if cfg.output else None)
    if path and os.path.isfile(path):
        records = {s: r for s, r in _last_per_step(path).items() if s <= start + len(losses)}
        steps = sorted(records)
        return steps, {k: [math.nan if records[s].get(k) is None else records[s][k] for s in steps]
                       for k in ("loss", "lm_loss", "mtp_loss", "indexer_loss")}
    return list(range(start + 1, start + len(losses) + 1)), {"loss": losses, "lm_loss": lm, "indexer_loss": idx}


def _plot_losses(cfg: TrainConfig, start: int, losses: list[float], lm: list[float], idx: list[float]) -> None:
    """``<log-dir or output>/loss.png``: the curves of :func:`loss_history`."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed: a file only
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("no loss.png: matplotlib is not installed (pip install 'csattn[data]')", stacklevel=2)
        return
    steps, series = loss_history(cfg, start, losses, lm, idx)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for key in ("loss", "lm_loss", "mtp_loss"):
        if key in series:
            top.plot(steps, series[key], label=key)
    top.set_ylabel("loss")
    top.legend()
    top.grid(alpha=0.3)
    bottom.plot(steps, series["indexer_loss"], color="tab:red", label="indexer_loss (KL)")
    bottom.set_xlabel("step")
    bottom.set_ylabel("indexer loss")
    bottom.legend()
    bottom.grid(alpha=0.3)
    out_dir = cfg.log_dir or cfg.output
    os.makedirs(out_dir, exist_ok=True)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=100)
    plt.close(fig)


def _peak_flops(cfg: TrainConfig, device: torch.device) -> float:
    """FLOP/s of one GPU for the MFU figure: ``--peak-tflops``, else the measured dense bf16 matmul rate of a
    known GPU (H100 / H200: 790 TFLOP/s), else 0 (no MFU shown)."""
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12
    if device.type == "cuda" and any(name in torch.cuda.get_device_name(device) for name in ("H100", "H200")):
        return 790e12
    return 0.0


def _save(cfg: TrainConfig, step: int, model: DeepseekV4ForCausalLM, optimizer: torch.optim.Optimizer,
          scheduler: Any, packer_state: dict[str, Any], topo: Topology) -> None:
    packers = [packer_state]
    if topo.world > 1:
        everyone: list[Any] = [None] * topo.world
        dist.all_gather_object(everyone, packer_state)
        packers = [everyone[r * topo.cp] for r in range(topo.dp)]  # one per replica (its CP rank 0)
    if topo.rank == 0:
        path = save_checkpoint(cfg.output, step, model, {
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "packers": packers,
            "rng": torch.get_rng_state(), "dp": topo.dp, "cp": topo.cp, "train_config": asdict(cfg),
            "model_training": model.config.training_dict(),
        })
        from tqdm import tqdm

        tqdm.write(f"saved checkpoint {path}")  # above any progress bar
        if cfg.keep_last:
            for old in prune_checkpoints(cfg.output, cfg.keep_last):
                tqdm.write(f"removed checkpoint {old} (--keep-last {cfg.keep_last})")
    if topo.world > 1:
        dist.barrier()
