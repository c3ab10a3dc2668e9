"""Estimated step time of one plan (:func:`step_time`): the FLOPs actually run at the measured one-GPU MFU, FP8
GEMMs at their measured rate (both from ``measured.py``), plus the communication model."""

from __future__ import annotations

import math

from ...models.deepseek_v4.config import DeepseekV4ModelConfig
from ...models.deepseek_v4.flops import PEAK_FLOPS, finetune_flops
from ..mesh import ParallelDims
from .counts import Training, cached, flop_counts
from .measured import FP8_GEMM_SPEEDUP, MFU_BY_ROWS, RECOMPUTE_SLOWDOWN
from .records import Part, Plan, Sizes

__all__ = ["NVLINK_BPS", "IB_BPS", "GPUS_PER_NODE", "mfu_at", "step_flops", "step_time"]

NVLINK_BPS = 900e9  # bytes/s per GPU within a node
IB_BPS = 50e9  # bytes/s per GPU across nodes (400 Gb/s)
GPUS_PER_NODE = 8


def mfu_at(rows: float) -> float:
    """Measured one-GPU MFU at ``rows`` tokens per rank (:data:`MFU_BY_ROWS`, log-linear between the measured points,
    held outside)."""
    pts = sorted(MFU_BY_ROWS.items())
    if rows <= pts[0][0]:
        return pts[0][1]
    for (a, fa), (b, fb) in zip(pts, pts[1:]):
        if rows <= b:
            t = math.log(rows / a) / math.log(b / a)
            return fa + t * (fb - fa)
    return pts[-1][1]


def step_flops(c: DeepseekV4ModelConfig, seq_len: int, t: Training) -> tuple[float, float]:
    """``(bf16 FLOPs, FP8-held FLOPs)`` run on one sequence of ``seq_len`` tokens under ``t``:
    :func:`~csattn.models.deepseek_v4.flops.finetune_flops` of the groups' counts (:func:`flop_counts`: no
    weight-gradient GEMM for a frozen group, LoRA's GEMMs), the forward and
    input-gradient GEMMs of FP8-held groups counted apart (either compute mode: the caller applies its rate)."""
    def f() -> tuple[float, float]:
        fl = finetune_flops(c, [0, seq_len], **flop_counts(c, t))
        return fl["fwd"] + fl["bwd"] - fl["fp8"], fl["fp8"]

    return cached(c, "step_flops", (seq_len, t), f)


def _bw(group: int, stride: int) -> float:
    """Bytes/s per GPU of a collective over ``group`` ranks ``stride`` apart: NVLink when they share a node."""
    span = (group - 1) * stride + 1
    return NVLINK_BPS if span <= GPUS_PER_NODE else IB_BPS


def step_time(p: Plan, c: DeepseekV4ModelConfig, dims: ParallelDims, sz: Sizes, t: Training) -> None:
    """Fill ``p.time`` / ``p.step_s``: compute at the measured MFU plus communication.

    Communication model (per rank, ring collectives, ``bytes x (g - 1) / g`` over the slowest link of the group:
    NVLink 900 GB/s when the group lies in one node of 8, InfiniBand 50 GB/s per GPU otherwise):

    - FSDP: per unit two all-gathers (forward, and again for the backward: units reshard after their forward) in
      the compute dtype (frozen weights as held) and one fp32 reduce-scatter of what trains; overlapped with
      compute except the first unit's all-gather and the last unit's reduce-scatter, and except what exceeds the
      compute time; ``dp_replicate`` adds an fp32 all-reduce of the trained shard across replicas, overlapped the
      same way;
    - EP: 4 all-to-alls per MoE layer (dispatch and combine, forward and backward) of ``rows x k x D`` bf16, plus
      2 more when the MoE's forward is recomputed (moe / block / full); not overlapped;
    - CP: the halo and the compressed entries per layer, not overlapped (small).
    """
    seqs = p.batch_seqs // dims.dp
    bf16, fp8 = step_flops(c, p.seq_len, t)
    mfu = mfu_at(p.rows)
    tm = p.time
    rate = FP8_GEMM_SPEEDUP.get(t.base_precision, 1.0)
    tm["compute"] = ((bf16 + fp8 / rate) * seqs / dims.cp / (mfu * PEAK_FLOPS)
                     * RECOMPUTE_SLOWDOWN[p.recompute])
    cb = 2 if p.dtype == "bfloat16" else 4
    tm["fsdp exposed"] = tm["ep all-to-all"] = tm["cp"] = 0.0
    if dims.world > 1:
        _fsdp_time(p, dims, sz, cb)
        if dims.ep > 1:
            ep = dims.ep
            exchanges = 4 + (2 if p.recompute in ("moe", "block", "full") else 0)
            vol = p.rows * c.num_experts_per_tok * c.hidden_size * 2.0 * (ep - 1) / ep
            tm["ep all-to-all"] = sz.blocks * exchanges * vol / _bw(ep, 1)
        if dims.cp > 1:
            a = c.attention_config(0)
            per_layer = c.sliding_window * a.head_dim * 2.0 * 2 + seqs * p.seq_len / 4 * (
                a.head_dim + c.index_head_dim) * 2.0 * (dims.cp - 1) / dims.cp
            tm["cp"] = sz.blocks * 2 * per_layer / _bw(dims.cp, 1)
    p.step_s = tm["compute"] + tm["fsdp exposed"] + tm["ep all-to-all"] + tm["cp"]
    p.tokens_per_s = p.seq_len * p.batch_seqs / p.step_s
    p.notes.append(f"compute at {mfu * 100:.1f} % MFU (measured one-GPU proxy), x{RECOMPUTE_SLOWDOWN[p.recompute]:.2f}"
                   f" for recompute {p.recompute}")
    if fp8:
        p.notes.append(f"GEMMs of FP8-held weights ({fp8 / (bf16 + fp8) * 100:.0f} % of the FLOPs, {t.base_precision}) "
                       f"at {rate:.2f}x the bf16 rate (measured: the frozen experts on the H200)")


def _fsdp_time(p: Plan, dims: ParallelDims, sz: Sizes, cb: int) -> None:
    f, ef, ep = dims.fsdp, dims.efsdp, dims.ep
    dense_bw, exp_bw = _bw(f, 1), _bw(ef, ep)

    def moved(part: Part) -> float:  # bytes of two all-gathers and one reduce-scatter
        return 2 * (cb * part.train_elems + part.frozen) + 4.0 * part.train_elems

    per_unit_dense = moved(sz.unit_dense) * (f - 1) / f / dense_bw
    per_unit_exp = moved(sz.unit_experts) / ep * (ef - 1) / ef / exp_bw
    comm = moved(sz.dense) * (f - 1) / f / dense_bw + sz.blocks * per_unit_exp
    if dims.dp_replicate > 1:
        r = dims.dp_replicate
        comm += 2 * 4.0 * (sz.dense.train_elems + sz.experts.train_elems) / f * (r - 1) / r / _bw(r, f)
    root = (cb * sz.root.train_elems + sz.root.frozen) * (f - 1) / f / dense_bw
    p.time["fsdp total"] = comm
    p.time["fsdp exposed"] = root + per_unit_dense + per_unit_exp + max(0.0, comm - p.time["compute"])

