"""The build phase of a run: the process group and the named ``DeviceMesh`` (dp_replicate x dp_shard x cp, experts
over ep), the model built on the meta device with its fine-tuning choices (frozen groups, LoRA, an FP8-held base:
``csattn.finetune``) and sharded with FSDP2 (``csattn.parallel``), AdamW and its LR schedule, and the data reader.

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
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..finetune.precision import check_fp8_mesh, hold_base
from ..finetune.setup import Finetune
from ..models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig
from ..models.deepseek_v4.checkpoint import read_config
from ..ops.backend import resolve_backend
from ..parallel import Meshes, ParallelDims, build_meshes, check_launch, load_hf_sharded, materialize
from ..parallel import parallelize as parallelize_model
from .config import TrainConfig, tiny_model_config
from .data import build_corpus, load_tokenizer
from .errors import TrainWarning, user_errors
from .packer import DocumentPacker, PackedBatch, concat_batches
from .step import TrainState

__all__ = ["Trainer", "build", "setup_distributed", "check_launch_options", "build_model_config", "build_model",
           "build_optimizer", "lr_lambda", "BatchReader", "offload_hint"]


@dataclass
class Trainer:
    """A built run: the step's :class:`TrainState`, this data replica's reader and what a save keeps beside them."""

    state: TrainState
    reader: BatchReader  # its batch_seqs: the sequences of a global batch
    tokenizer: Any


def build(cfg: TrainConfig, meshes: Meshes, device: torch.device, saved: dict[str, Any] | None = None) -> Trainer:
    """Everything a run needs on ``meshes`` (:func:`setup_distributed`), fresh or for the resumed checkpoint whose
    trainer state is ``saved`` (it keeps its ``batch_seqs``); its weights are still the fresh or ``--init-from``
    ones (the checkpoint phase restores the rest)."""
    dims = meshes.dims
    with user_errors():  # the batch size against the mesh, the tokenizer
        batch_seqs = int(saved.get("batch_seqs", saved.get("dp", 1))) if saved else (cfg.batch_seqs or dims.dp)
        if batch_seqs % dims.dp:
            which = " (the checkpoint's)" if saved else ""
            raise ValueError(f"{batch_seqs} packed sequences per step{which} do not split over {dims.dp} data "
                             f"replicas (--dp-replicate x --dp-shard): pick sizes whose data replicas divide "
                             f"{batch_seqs}")
        tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
        model_cfg = build_model_config(cfg, len(tokenizer) if tokenizer is not None else None,
                                       special_ids=_special_ids(tokenizer))
    tuning = Finetune.from_options(cfg)  # what trains and the LoRA: the model's build and the step read it
    model, cp = build_model(cfg, model_cfg, meshes, device, tuning)
    per, dp_rank = batch_seqs // dims.dp, meshes.coords["dp"]
    with user_errors():  # the data files
        reader = BatchReader(cfg, model_cfg, tokenizer, 1 + len(model.mtp), batch_seqs,
                             range(dp_rank * per, (dp_rank + 1) * per))
    optimizer = build_optimizer(model, cfg, device)
    bias_rate = tuning.router_bias_rate(cfg.router_bias_rate)  # 0 with a frozen router
    state = TrainState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg)), meshes,
                       device, cp, cfg.grad_clip, bias_rate)
    return Trainer(state, reader, tokenizer)


def check_launch_options(cfg: TrainConfig) -> tuple[ParallelDims, bool, str]:
    """What the options and torchrun's environment decide before any process group exists: the mesh sizes
    resolved against ``WORLD_SIZE`` (the check :func:`csattn.parallel.build_meshes` makes), whether to run on CUDA
    and the process-group backend. Raises ``ValueError`` naming the option; every rank reads the same environment,
    so every rank raises the same one and none is left in the group's rendezvous waiting for a rank that left."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        # checked here: torch would fail later with an AttributeError deep in torch.cuda.set_device
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"--device cuda: {why} (torch {torch.__version__}); install the CUDA build of torch on "
                         "a GPU machine, or pass --device cpu (or --device auto)")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    # --backend triton off CUDA (without Triton's interpreter) would otherwise fail only at the first
    # forward
    resolve_backend(cfg.backend, "cuda" if use_cuda else "cpu")
    dims = check_launch(ParallelDims(dp_replicate=cfg.dp_replicate, dp_shard=cfg.dp_shard, cp=cfg.cp, ep=cfg.ep))
    check_fp8_mesh(dims, cfg.base_precision)
    backend = cfg.dist_backend if cfg.dist_backend != "auto" else "nccl" if use_cuda else "gloo"
    if dims.world > 1 and not dist.is_initialized():
        _check_gpus_per_node(backend, use_cuda)
    return dims, use_cuda, backend


def setup_distributed(cfg: TrainConfig) -> tuple[Meshes, torch.device]:
    """Initialize ``torch.distributed`` from torchrun's environment if needed (NCCL on GPUs, gloo on CPU) and build
    the meshes of ``--dp-replicate / --dp-shard / --cp / --ep``, after :func:`check_launch_options`."""
    dims, use_cuda, backend = check_launch_options(cfg)
    if dims.world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.dist_timeout))
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("cpu")
    if use_cuda:  # ranks beyond the GPU count share GPUs (gloo only: NCCL takes one rank per GPU)
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
    return build_meshes(dims, device.type), device


def _check_gpus_per_node(backend: str, use_cuda: bool) -> None:
    """NCCL takes one GPU per rank: more ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``) than visible GPUs
    would fail at the first collective with NCCL's duplicate-GPU error."""
    local_world, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
    if backend == "nccl" and use_cuda and local_world > gpus:
        raise ValueError(f"{local_world} processes on this node (torchrun --nproc-per-node) but {gpus} GPU(s) are "
                         f"visible, and NCCL takes one GPU per rank: start at most {gpus} per node, or pass "
                         "--dist-backend gloo to share GPUs")


def offload_hint(cfg: TrainConfig, device: torch.device, rank: int) -> None:
    """A note (rank 0) when ``--offload-block-inputs`` runs on CUDA without the allocator setting it needs."""
    if cfg.offload_block_inputs and device.type == "cuda" and rank == 0 and \
            "expandable_segments:True" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        # a hint only: the allocator setting is PyTorch's own and must be set before CUDA starts
        print("note: --offload-block-inputs is for the longest sequences; there PyTorch's allocator may fail on "
              "fragments (tens of GiB reserved but unallocated): run with "
              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", flush=True)


def build_model_config(cfg: TrainConfig, tokenizer_vocab: int | None = None,
                       special_ids: dict[str, Any] | None = None) -> DeepseekV4ModelConfig:
    """The model to train; from scratch its vocabulary is the tokenizer's (``tokenizer_vocab``, loaded from
    ``cfg.tokenizer`` if not given) or ``cfg.vocab_size``. ``special_ids``: the tokenizer's BOS / EOS / PAD ids,
    which replace the config's (the data carries the tokenizer's)."""
    overrides: dict[str, Any] = dict(**(special_ids or {}), indexer_loss_coeff=cfg.indexer_loss_coeff,
                                     mtp_loss_coeff=cfg.mtp_loss_coeff,
                                     backend=cfg.backend,
                                     deterministic=cfg.deterministic,
                                     recompute=cfg.recompute,
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


def _special_ids(tokenizer: Any) -> dict[str, Any] | None:
    """The tokenizer's BOS / EOS / PAD ids for the model config (so the saved config.json agrees with the tokenizer
    saved next to it, and HF ``generate`` stops at its EOS); None without a tokenizer."""
    if tokenizer is None:
        return None
    return {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad")}


def build_model(cfg: TrainConfig, model_cfg: DeepseekV4ModelConfig, meshes: Meshes, device: torch.device,
                tuning: Finetune) -> tuple[DeepseekV4ForCausalLM, Any]:
    """The model on the meta device, sharded over ``meshes``, then given storage and weights one unit at a time
    (fresh from ``--seed``, or ``--init-from``'s HF checkpoint); returns it and its ``ContextParallel``.
    ``tuning``: the frozen groups and LoRA, applied between the expert split and FSDP."""
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
    hold_base(model, cfg, tuning.choice)  # --base-precision fp8 / w8a16: FP8-held modules, before sharding
    cp = parallelize_model(model, meshes, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                           cp_partition=cfg.cp_partition, prepare=tuning.prepare)
    if not cfg.init_from:
        return tuning.initialize(materialize(model, device, cfg.seed)), cp
    n_mtp = model_cfg.num_nextn_predict_layers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with user_errors():  # missing or misshaped tensors of the --init-from directory
            load_hf_sharded(model, cfg.init_from, device, allow_inexact_fp8=cfg.allow_inexact_fp8, seed=cfg.seed)
    fresh = (f"--init-from {cfg.init_from}: no mtp.* tensors; the {n_mtp} MTP block(s) start from fresh weights "
             "(pass --mtp-layers 0 to train without MTP)")
    _relay_warnings(caught, meshes.rank, lambda m: fresh if "no mtp.* tensors" in m else m)
    return tuning.initialize(model), cp


_CSATTN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _relay_warnings(caught: list[warnings.WarningMessage], rank: int, rewrite: Any = None) -> None:
    """Warn again, once each and on rank 0 only, what a phase that every rank runs alike warned: csattn's own
    ``UserWarning``s as :class:`TrainWarning` (``rewrite(message)`` may restate them for the command line), any
    other warning (torch's) as it was."""
    if rank != 0:
        return
    for w in {(str(w.message), w.category, w.filename): w for w in caught}.values():
        ours = w.category is UserWarning and os.path.abspath(w.filename).startswith(_CSATTN_DIR + os.sep)
        message = str(w.message)
        if ours:
            warnings.warn(rewrite(message) if rewrite else message, TrainWarning, stacklevel=3)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

def build_optimizer(model: DeepseekV4ForCausalLM, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the parameters that train; weight decay on matrices only (not on norms, sinks, position / router
    biases, nor the mHC weights)."""
    # weight decay on matrices only: not on norms, sinks, position / router biases, nor the mHC weights
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:  # frozen (csattn.finetune): no optimizer state
            continue
        mhc = any(part in ("attn_hc", "ffn_hc", "hc_head") for part in name.split("."))
        (decay if p.dim() >= 2 and not mhc else no_decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
        fused=device.type == "cuda")  # one kernel for all parameters on the GPU (the CPU keeps the default path)


def lr_lambda(cfg: TrainConfig) -> Any:
    """The LR factor of each step: linear warmup, then a cosine decay to ``--min-lr`` at ``--steps``."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(cfg.steps - cfg.warmup_steps, 1)
        frac = min((step - cfg.warmup_steps) / span, 1.0)
        floor = cfg.min_lr / cfg.lr if cfg.lr else 0.0
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))
    return f


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
