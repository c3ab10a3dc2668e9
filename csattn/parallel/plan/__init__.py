"""Memory and step-time planner for sharded training (``csattn plan``): per-rank bytes and an estimated step time
of a :class:`DeepseekV4ModelConfig` on a :class:`ParallelDims` mesh of H200s, from geometry and measured constants.

Pure functions, no GPU, no process group. What a rank holds (``csattn.parallel.parallelize``'s layout):

- **one process** (``world == 1``): no FSDP; ``--dtype bfloat16`` stores the matrices in bf16 (mHC, norms, sinks,
  position biases in fp32), gradients and AdamW's two moments in the parameters' dtype;
- **sharded**: FSDP2 over ``dp_shard x cp`` (experts: ``ep`` x ``efsdp``, the experts' FSDP mesh: what ``ep``
  leaves of ``dp_shard x cp``), fp32 master weights, fp32 gradients (sharded), fp32 AdamW state: 16 bytes a
  trained parameter / ``fsdp``; bf16 compute copies of the units in flight (the root, embedding + LM head, stays
  gathered for the step; each decoder block with its experts is gathered for its forward and again for its
  backward, one unit prefetched ahead: two units counted);
- **fine-tuning** (:class:`Training`): frozen groups hold only their weights (FP8 with 128x128 block scales, or
  bf16), no gradient, optimizer state or reduce-scatter, and skip their weight-gradient GEMM; LoRA pairs train
  like any parameter.

The phases, one module each, each importing only those before it: ``load`` (the model's ``config.json``),
``counts`` (parameters by kind and by fine-tuning group), ``records`` (the :class:`Plan` record and the H200 it must
fit), ``measured`` (the measured constants, generated), ``timing`` (FLOPs run, MFU, communication), ``memory``
(per-rank bytes, the peak that decides the fit; builds the plan), ``meshes`` (the search, what would fit, the docs
table), ``cli`` (``csattn plan``).

Kept activations come from the measured bytes per token per layer of the proxy (:data:`KEPT_KIB`), scaled by the
geometry; the backward's transient memory from the proxy's measured step peaks (:data:`TRANSIENT`). The step time
is the FLOPs run at the measured one-GPU MFU (:data:`MFU_BY_ROWS`) times the recompute's measured slow-down, plus
the communication model of :func:`step_time`. ``measured.py`` (``TRANSIENT``, ``MFU_BY_ROWS``, ``FP8_GEMM_SPEEDUP``)
is written by ``python -m benchmarks.results`` from ``benchmarks/results/h200/``: re-measuring updates the planner.
"""

from __future__ import annotations

from .cli import add_plan_args, format_plan, main, run_plan, train_command
from .counts import (
    BASE_PRECISIONS,
    DEFAULT_LORA_TARGETS,
    FP8_GROUPS,
    GROUPS,
    GroupCount,
    GroupCounts,
    ParamCounts,
    Training,
    count_groups,
    count_params,
    flop_counts,
    group_of,
    training_spec,
)
from .load import load_config
from .measured import FP8_GEMM_SPEEDUP, KEPT_KIB, MFU_BY_ROWS, RECOMPUTE_SLOWDOWN, TRANSIENT
from .memory import FP8_BYTES, fp8_workspace, kept_bytes_per_token, plan
from .meshes import docs_table, nearest_fits, rank_plans, search
from .records import H200_BYTES, HEADROOM, LIMIT_BYTES, Memory, Plan
from .timing import mfu_at, step_flops, step_time

__all__ = ["BASE_PRECISIONS", "DEFAULT_LORA_TARGETS", "FP8_BYTES", "FP8_GEMM_SPEEDUP", "FP8_GROUPS",
           "GROUPS", "GroupCount", "GroupCounts", "H200_BYTES", "HEADROOM", "KEPT_KIB",
           "LIMIT_BYTES", "MFU_BY_ROWS", "Memory", "ParamCounts", "Plan", "RECOMPUTE_SLOWDOWN", "TRANSIENT", "Training",
           "add_plan_args", "count_groups", "count_params", "docs_table", "flop_counts", "format_plan",
           "fp8_workspace", "group_of",
           "kept_bytes_per_token", "load_config", "main", "mfu_at", "nearest_fits", "plan", "rank_plans", "run_plan",
           "search", "step_flops", "step_time", "train_command", "training_spec"]
