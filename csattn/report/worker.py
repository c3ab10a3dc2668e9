"""What one process of the scaling report does: build a layer, run forward + backward on its rows of a
ragged packed batch, and record peak memory and step time.

A CP size of P runs P processes (gloo on CPU or when the ranks share one GPU, NCCL when every rank has its
own GPU). The per-rank *isolated* timing runs one process per rank with torch's fake process group, so a
rank's compute is timed without the other ranks time-slicing the same GPU: that is the work-balance number.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from ..config import AttentionConfig
from ..layers import HybridAttention
from ..models.deepseek_v4.flops import layer_flops
from ..packing import PackedSeqs

__all__ = ["Job", "report_config", "ragged_lengths", "init_rank", "build_case", "run_group", "run_isolated"]


@dataclass(frozen=True)
class Job:
    layer: str  # "csa" | "hca"
    tokens: int
    path: str  # "triton" | "reference" | "unfused" | "hf"
    partition: str = "contiguous"


PATHS = {  # report path -> (backend, recompute_projections)
    "triton": ("triton", True),  # the fused kernels and the block-recomputed core: the default on CUDA
    "reference": ("reference", True),  # the PyTorch reference ops inside the same block-recomputed core
    "unfused": ("reference", False),  # the reference ops with every [T, H, d] tensor kept for the backward
}


def report_config(layer: str, geometry: str, path: str) -> AttentionConfig:
    """V4-Flash attention geometry (``"real"``) or a tiny one for CPU smoke runs (``"tiny"``), set up for one of
    the report's ``PATHS`` (HF eager takes the reference's config)."""
    backend, recompute = PATHS.get(path, PATHS["reference"])
    if geometry == "real":
        return AttentionConfig(layer_type=layer, compress_ratio={"csa": 4, "hca": 128}[layer],
                               indexer_loss_coeff=0.01, backend=backend, recompute_projections=recompute)
    return AttentionConfig(
        hidden_size=64, num_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        sliding_window=16, layer_type=layer, compress_ratio={"csa": 4, "hca": 16}[layer], index_n_heads=4,
        index_head_dim=16, index_topk=8, indexer_loss_coeff=0.01, backend=backend, recompute_projections=recompute,
    )


def ragged_lengths(tokens: int, seed: int = 0) -> list[int]:
    """Ragged documents (log-uniform lengths between tokens/64 and tokens/2) filling exactly ``tokens``."""
    g = torch.Generator().manual_seed(seed + tokens)
    lo, hi = max(16, tokens // 64), max(32, tokens // 2)
    out, left = [], tokens
    while left > 0:
        u = float(torch.rand((), generator=g))
        n = min(left, int(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))))
        out.append(n)
        left -= n
    return out


def _device(rank: int, want: str) -> torch.device:
    if want == "cuda" and torch.cuda.is_available():
        # ranks spread over the GPUs, several to a GPU (gloo) when there are more ranks than GPUs
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_rank(rank: int, world: int, port: int, want: str, timeout_s: int = 300) -> torch.device:
    """This rank's device (set as current) and, for ``world > 1``, its process group: NCCL with one GPU per
    rank, gloo when ranks share GPUs or run on the CPU."""
    device = _device(rank, want)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        backend = "nccl" if device.type == "cuda" and torch.cuda.device_count() >= world else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    return device


def _case_inputs(job: Job, opts: dict) -> tuple[AttentionConfig, list[int], Tensor, torch.Generator]:
    """Config, document lengths and the whole stream's input ``[T, D]`` (on the host) of ``job``."""
    cfg = report_config(job.layer, opts["geometry"], job.path)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x_global = torch.randn(job.tokens, cfg.hidden_size, generator=g).to(getattr(torch, opts["dtype"]))
    return cfg, ragged_lengths(job.tokens), x_global, g


def build_case(job: Job, opts: dict, device: torch.device, cp) -> tuple[AttentionConfig, HybridAttention,
                                                                          PackedSeqs, Tensor, torch.Generator]:
    """The layer of ``job`` on ``device`` and this rank's input rows ``[T / P, D]`` (requires grad) of the
    ragged pack; the generator continues the input's stream (for the output gradient)."""
    cfg, lengths, x_global, g = _case_inputs(job, opts)
    layer = HybridAttention(cfg).to(device=device, dtype=x_global.dtype)
    packed = PackedSeqs.from_lengths(lengths, device=device)
    x_local = cp.shard(x_global, PackedSeqs.from_lengths(lengths)) if cp is not None else x_global
    return cfg, layer, packed, x_local.to(device).requires_grad_(), g


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(job: Job, opts: dict, device: torch.device, cp) -> dict:
    """Time ``opts['steps']`` forward + backward steps of ``job`` on this rank; peak memory of one step."""
    if job.path == "hf":
        return _measure_hf(job, opts, device)
    cfg, layer, packed, x_local, g = build_case(job, opts, device, cp)
    lengths = ragged_lengths(job.tokens)
    packed_cpu = PackedSeqs.from_lengths(lengths)
    dy = torch.randn(x_local.shape, generator=g).to(device=device, dtype=x_local.dtype)

    acts: list[float] = []

    def step():
        for p in layer.parameters():
            p.grad = None
        x_local.grad = None
        start = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        y = layer(x_local, packed=packed, cp=cp)
        if device.type == "cuda":  # what the forward keeps for the backward (its output included)
            acts.append((torch.cuda.memory_allocated(device) - start) / 2**30)
        y.backward(dy)

    barrier = (lambda: dist.barrier(group=cp.group)) if cp is not None and opts.get("barrier", True) else None
    ms, peak = _time_steps(step, device, opts["steps"], before=barrier)
    # acts[0] is the warm-up step's, which also holds what the process allocates once and keeps (cuBLAS
    # workspaces, 32 MiB on Hopper): not activations. The timed steps see those already allocated.
    act = max(acts[1:]) if len(acts) > 1 else None
    flops = layer_flops(cfg, lengths)
    local_flops = None
    if cp is not None:
        from ..cp import make_layout, partition_flops

        layout = make_layout(packed_cpu, cp.partition, cp.size, cp.chunks_per_rank, cp.cost_config)
        local_flops = float(partition_flops(layout, packed_cpu, cfg)[cp.rank])
    return {"ms": ms, "peak_gib": peak, "act_gib": act, "docs": len(lengths),
            "flops_fwdbwd": flops["fwd"] + flops["bwd"],
            "tflops": (flops["fwd"] + flops["bwd"]) / (cp.size if cp else 1) / ms / 1e9,
            "rank_model_flops": local_flops}


def _measure_hf(job: Job, opts: dict, device: torch.device) -> dict:
    """HF ``DeepseekV4Attention`` eager, one document at a time (it cannot pack), same total work."""
    from .hf import build_hf_attention

    cfg, lengths, x_global, _ = _case_inputs(job, opts)
    attn, run = build_hf_attention(cfg, device, x_global.dtype)
    docs = list(torch.split(x_global, lengths))

    def step():
        for p in attn.parameters():
            p.grad = None
        for xd in docs:
            run(xd.to(device)[None].requires_grad_()).sum().backward()

    ms, peak = _time_steps(step, device, opts["steps"])
    flops = layer_flops(cfg, lengths)
    return {"ms": ms, "peak_gib": peak, "docs": len(lengths), "flops_fwdbwd": flops["fwd"] + flops["bwd"],
            "tflops": (flops["fwd"] + flops["bwd"]) / ms / 1e9, "rank_model_flops": None}


def _time_steps(step, device: torch.device, steps: int, before=None) -> tuple[float, float | None]:
    """One warm-up call (compilation, caches), then the median ms of ``steps`` calls and the peak GiB
    allocated during them beyond what was allocated before (None on CPU)."""
    step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    times = []
    for _ in range(steps):
        if before is not None:
            before()
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if device.type == "cuda" else None
    return statistics.median(times), peak


def _record(job: Job, world: int, rank: int, opts: dict, result: dict, kind: str) -> dict:
    return {**asdict(job), "cp": world, "rank": rank, "kind": kind, "dtype": opts["dtype"], **result}


def run_group(rank: int, world: int, port: int, jobs: list[Job], opts: dict, out_path: str) -> None:
    """Entry point of one spawned rank: run ``jobs`` in order and append one JSON line per job.

    A job that fails (out of memory, ...) on any rank ends the group: every rank stops at the next
    collective, and the parent restarts the remaining jobs in a new group.
    """
    device = init_rank(rank, world, port, opts["device"], opts.get("timeout_s", 300))
    cp = None
    try:
        for job in jobs:
            if world > 1:
                from ..cp import ContextParallel

                cp = ContextParallel(None, partition=job.partition)
            try:
                result = _measure(job, opts, device, cp)
                rec = _record(job, world, rank, opts, result, "group")
            except torch.cuda.OutOfMemoryError:
                rec = _record(job, world, rank, opts, {"error": "out of memory"}, "group")
            with open(f"{out_path}.{rank}", "a") as f:
                f.write(json.dumps(rec) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if "error" in rec:
                os._exit(3)  # a failed rank cannot rejoin the group's collectives
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def run_isolated(jobs: list[Job], sizes: list[int], opts: dict, out_path: str) -> None:
    """Time every rank of every CP size alone, with torch's fake process group (collectives are no-ops that
    keep shapes), so per-rank compute is measured without other ranks sharing the GPU."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..cp import ContextParallel

    device = _device(0, opts["device"])
    for job in jobs:
        for size in sizes:
            for rank in range(size):
                dist.init_process_group("fake", rank=rank, world_size=size, store=FakeStore())
                try:
                    cp = ContextParallel(None, partition=job.partition)
                    result = _measure(job, {**opts, "barrier": False}, device, cp)
                    rec = _record(job, size, rank, opts, result, "isolated")
                except torch.cuda.OutOfMemoryError:
                    rec = _record(job, size, rank, opts, {"error": "out of memory"}, "isolated")
                finally:
                    dist.destroy_process_group()
                with open(out_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
