"""Memory and step-time planner for sharded training (``csattn plan``): per-rank bytes and an estimated step time
of a :class:`DeepseekV4ModelConfig` on a :class:`ParallelDims` mesh of H200s, from geometry and measured constants.

Pure functions, no GPU, no process group. What a rank holds (``csattn.parallel.parallelize``'s layout):

- **one process** (``world == 1``): no FSDP; ``--dtype bfloat16`` stores the matrices in bf16 (mHC, norms, sinks,
  position biases in fp32), gradients and AdamW's two moments in the parameters' dtype;
- **sharded**: FSDP2 over ``dp_shard x cp`` (experts: ``ep`` x ``efsdp``), fp32 master weights, fp32 gradients
  (sharded), fp32 AdamW state: 16 bytes a parameter / ``fsdp``; bf16 compute copies of the units in flight (the
  root, embedding + LM head, stays gathered for the step; each decoder block with its experts is gathered for its
  forward and again for its backward, one unit prefetched ahead: two units counted).

Kept activations come from the measured bytes per token per layer of the proxy (:data:`KEPT_KIB`), scaled by the
geometry; the backward's transient memory from the proxy's measured step peaks (:data:`TRANSIENT`). The step
time is ``model_flops`` at the measured one-GPU MFU (:data:`MFU_BY_ROWS`) times the recompute's measured
slow-down, plus the communication model of :func:`step_time`.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..models.deepseek_v4.config import RECOMPUTE_CHOICES, DeepseekV4ModelConfig
from ..report.flops import PEAK_FLOPS
from .mesh import ParallelDims

__all__ = ["H200_BYTES", "HEADROOM", "KEPT_KIB", "MFU_BY_ROWS", "ParamCounts", "Plan", "count_params", "plan",
           "search", "format_plan", "docs_table", "main"]

GiB = 2**30
H200_BYTES = 141e9  # the H200's memory (141 GB)
HEADROOM = 0.05  # left to the caching allocator (fragmentation, reserved-but-free blocks)
NVLINK_BPS = 900e9  # bytes/s per GPU within a node
IB_BPS = 50e9  # bytes/s per GPU across nodes (400 Gb/s)
GPUS_PER_NODE = 8

# Kept for the backward, KiB per token per layer, measured on the 4-layer proxy at 16k tokens, recompute none
# (lab/results/model_kept_16k_h200_3f37546.txt, `python -m benchmarks.live_tensors --model --tokens 16384`).
# Geometry of the measurement: D 4096, hc_mult 4, top-2 of 8 experts, I 2048, q_lora 1024, index_topk 512.
KEPT_KIB = {
    "combines": 64.0,  # two bf16 stream sets [n, D] (scales with n * D)
    "moe": 34.11,  # routed gate/up [k, 2I] 16 + shared [2I] 8 + output [D] 8 + routing 2.11
    "attn_sliding": 15.27,  # output [D] 8 + query latent, keys (scale with q_lora)
    "attn_csa": 27.27,  # + compressed entries, indexer state; top-k ids (int64) and teacher masses (fp32) 6
    "attn_hca": 17.29,
    "mhc": 0.36,  # the two sites' logits and scales
    "embed": 8.0,  # per model: the embedding [D]
    "head": 8.02,  # per model (and per MTP head): the head's normed output [D]
}
# The backward's memory beyond what is kept, the proxy's step peak minus its kept bytes (benchmarks/results/h200/
# model.json 16k 9.60 GiB and 64k 34.15 GiB, model_128k.json 66.38 GiB, recompute none): a fixed part (the
# attention core's workspace, 1 GiB by default, and the kernels' buffers) plus a part per token of the rank
# (stream gradients, one layer's backward temporaries); fits 64k within 0.6 %.
TRANSIENT = {"fixed_gib": 1.493 - 1.0, "kib_per_token": 22.1}
# Measured one-GPU MFU of the proxy by tokens per step (benchmarks/results/h200/model.json, model_128k.json);
# interpolated in log(tokens), held outside.
MFU_BY_ROWS = {16384: 0.436, 65536: 0.420, 131072: 0.424}
# Step time of each recompute relative to none, the proxy at 16k (benchmarks.run --op model --shape
# recompute=none,mhc,moe,block,full; ms per step, one H200).
RECOMPUTE_SLOWDOWN = {"none": 1.0, "mhc": 411.5 / 393.6, "moe": 409.0 / 393.6, "block": 496.8 / 393.6,
                      "full": 575.9 / 408.0}
_PROXY = {"D": 4096, "n": 4, "k": 2, "I": 2048, "ql": 1024, "topk": 512}


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts (elements). ``dense`` = everything but the routed experts; ``fp32`` = the part kept in fp32
    whatever the dtype (mHC, norms, sinks, position biases); ``unit_dense`` / ``unit_experts`` = the largest
    decoder / MTP block's dense part and routed experts (an FSDP unit each); ``root`` = embedding + LM head."""

    total: int
    dense: int
    experts: int
    fp32: int
    root: int
    unit_dense: int
    unit_experts: int
    blocks: int


def _attn_params(c: DeepseekV4ModelConfig, i: int) -> tuple[int, int]:
    a = c.attention_config(i)
    D, H, d, ql, g, ol = a.hidden_size, a.num_heads, a.head_dim, a.q_lora_rank, a.o_groups, a.o_lora_rank
    mat = D * ql + ql * H * d + D * d + g * ol * (H * d // g) + D * g * ol
    small = H + ql + d  # sinks, q_a_norm, kv_norm
    if a.layer_type == "csa":
        r, HI, cI = a.compress_ratio, a.index_n_heads, a.index_head_dim
        mat += 2 * (2 * d * D) + 2 * (2 * cI * D) + HI * cI * ql + HI * D
        small += r * 2 * d + d + r * 2 * cI + cI
    elif a.layer_type == "hca":
        r = a.compress_ratio
        mat += 2 * d * D
        small += r * d + d
    return mat, small


def count_params(c: DeepseekV4ModelConfig) -> ParamCounts:
    """The model's parameters by kind (decoder, MTP blocks, embedding, head), from the geometry alone."""
    D, n, E, I, V = c.hidden_size, c.hc_mult, c.n_routed_experts, c.moe_intermediate_size, c.vocab_size
    hc_site = (2 + n) * n * n * D + (2 + n) * n + 3
    hc_head = n * n * D + n + 1
    dense = experts = fp32 = 0
    unit_dense = 0
    blocks = c.num_hidden_layers + c.num_nextn_predict_layers
    for i in range(blocks):
        mat, small = _attn_params(c, i)
        mat += E * D + 3 * D * I  # router, shared expert
        small += 2 * hc_site + 2 * D  # mHC sites, the two RMSNorms
        if i >= c.num_hidden_layers:  # MTP block: e_proj, h_proj, enorm, hnorm, norm, hyper-head
            mat += 2 * D * D
            small += 3 * D + hc_head
        dense += mat + small
        fp32 += small
        unit_dense = max(unit_dense, mat + small)
        experts += E * 3 * D * I
    root = V * D * (1 if c.tie_word_embeddings else 2)
    dense += root + D + hc_head
    fp32 += D + hc_head
    return ParamCounts(total=dense + experts, dense=dense, experts=experts, fp32=fp32, root=root,
                       unit_dense=unit_dense, unit_experts=E * 3 * D * I, blocks=blocks)


_CACHE: dict[tuple[int, str, int], tuple[DeepseekV4ModelConfig, Any]] = {}


def _cached(c: DeepseekV4ModelConfig, what: str, key: int, fn: Any) -> Any:
    """``fn()`` once per config object (held, so its id is not reused) and key: the search plans hundreds of meshes."""
    k = (id(c), what, key)
    hit = _CACHE.get(k)
    if hit is None or hit[0] is not c:
        hit = _CACHE[k] = (c, fn())
    return hit[1]


def _layer_kinds(c: DeepseekV4ModelConfig) -> list[str]:
    n = c.num_hidden_layers
    return _cached(c, "kinds", 0, lambda: [c.attention_config(i).layer_type
                                           for i in range(n + c.num_nextn_predict_layers)])


def _seq_flops(c: DeepseekV4ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs of one sequence of ``seq_len`` tokens, one document."""
    from ..report.flops import model_flops

    def f() -> float:
        fl = model_flops(c, [0, seq_len])
        return fl["fwd"] + fl["bwd"]

    return _cached(c, "flops", seq_len, f)


def kept_bytes_per_token(c: DeepseekV4ModelConfig, recompute: str) -> dict[str, float]:
    """Bytes per token of the rank kept for the backward, by layer kind and per model, for ``recompute``:
    ``{"sliding"|"csa"|"hca": per layer, "model": embedding + heads, "recompute_extra": one layer's state alive
    while it is recomputed}``, scaled from :data:`KEPT_KIB` by the geometry."""
    K, p = 1024.0, _PROXY
    D, n, k, I = c.hidden_size, c.hc_mult, c.num_experts_per_tok, c.moe_intermediate_size
    ql, topk = c.q_lora_rank, c.index_topk
    combines = KEPT_KIB["combines"] * K * (n * D) / (p["n"] * p["D"])
    moe = (k * 2 * I * 2 + 2 * I * 2 + D * 2) + (KEPT_KIB["moe"] - 32.0) * K * k / p["k"]
    out = D * 2.0
    topk_part = 6.0 * K * topk / p["topk"]
    attn = {"sliding": (KEPT_KIB["attn_sliding"] - 8.0) * K * ql / p["ql"] + out,
            "csa": (KEPT_KIB["attn_csa"] - 14.0) * K * ql / p["ql"] + topk_part + out,
            "hca": (KEPT_KIB["attn_hca"] - 8.0) * K * ql / p["ql"] + out}
    mhc = KEPT_KIB["mhc"] * K
    heads = 1 + c.num_nextn_predict_layers
    model = (KEPT_KIB["embed"] + KEPT_KIB["head"] * heads) * K * D / p["D"]
    full_layer = {t: combines + moe + a + mhc for t, a in attn.items()}
    if recompute == "none":
        per = full_layer
        extra = 0.0
    elif recompute == "mhc":
        per = {t: combines + moe + a for t, a in attn.items()}
        extra = 0.0
    elif recompute == "moe":
        per = {t: combines + 2 * D * 2.0 + a + mhc for t, a in attn.items()}
        extra = moe  # the MoE's state while it is recomputed
    elif recompute == "block":
        per = {t: n * D * 2.0 for t in attn}  # one stream set per block boundary
        extra = max(full_layer.values())  # the recomputed block's whole state
    elif recompute == "full":
        per = {t: n * D * 2.0 for t in attn}
        extra = n * D * 2.0 + max(max(attn.values()), moe)  # one sub-block's state at a time
    else:
        raise ValueError(f"--recompute must be one of {RECOMPUTE_CHOICES}, got {recompute!r}")
    return {**per, "model": model, "recompute_extra": extra}


def mfu_at(rows: float) -> float:
    """Measured one-GPU MFU at ``rows`` tokens per rank (log-linear between the measured points)."""
    pts = sorted(MFU_BY_ROWS.items())
    if rows <= pts[0][0]:
        return pts[0][1]
    for (a, fa), (b, fb) in zip(pts, pts[1:]):
        if rows <= b:
            t = math.log(rows / a) / math.log(b / a)
            return fa + t * (fb - fa)
    return pts[-1][1]


@dataclass
class Plan:
    """One mesh's per-rank memory (bytes) and estimated step time (seconds)."""

    config: str
    gpus: int
    seq_len: int
    batch_seqs: int
    dims: dict[str, int]
    recompute: str
    dtype: str
    sharded: bool
    params_total: int
    rows: int  # stream rows a rank processes per step
    memory: dict[str, float] = field(default_factory=dict)
    total: float = 0.0
    peak: float = 0.0
    fits: bool = False
    time: dict[str, float] = field(default_factory=dict)
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def _bw(group: int, stride: int) -> float:
    """Bytes/s per GPU of a collective over ``group`` ranks ``stride`` apart: NVLink when they share a node."""
    span = (group - 1) * stride + 1
    return NVLINK_BPS if span <= GPUS_PER_NODE else IB_BPS


def plan(c: DeepseekV4ModelConfig, dims: ParallelDims, seq_len: int, *, batch_seqs: int | None = None,
         recompute: str = "none", dtype: str = "bfloat16", name: str = "") -> Plan:
    """Per-rank memory and step time of training ``c`` on ``dims`` (resolved here; ``ValueError`` naming the flag).

    Args:
        seq_len: tokens per packed sequence. batch_seqs: sequences per global step (default: one per data
            replica). recompute: one of ``RECOMPUTE_CHOICES``. dtype: ``bfloat16`` or ``float32``.
    """
    if seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {seq_len}")
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"--recompute must be one of {RECOMPUTE_CHOICES}, got {recompute!r}")
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"--dtype must be bfloat16 or float32, got {dtype!r}")
    if dims.world > 1:
        dims = dims.resolve()
    elif max(dims.dp_replicate, dims.cp, dims.ep, dims.dp_shard) > 1:
        raise ValueError("--gpus 1 takes no --dp-replicate / --dp-shard / --cp / --ep above 1")
    else:
        dims = replace(dims, dp_shard=1)
    E = c.n_routed_experts
    if E % dims.ep:
        raise ValueError(f"--ep {dims.ep} must divide the {E} routed experts")
    batch_seqs = dims.dp if batch_seqs is None else batch_seqs
    if batch_seqs < 1 or batch_seqs % dims.dp:
        raise ValueError(f"--batch-seqs {batch_seqs} must be a positive multiple of the {dims.dp} data replicas "
                         "(--dp-replicate x --dp-shard)")
    if seq_len % dims.cp:
        raise ValueError(f"--seq-len {seq_len} must be divisible by --cp {dims.cp}")
    pc = _cached(c, "params", 0, lambda: count_params(c))
    sharded = dims.world > 1
    rows = seq_len * (batch_seqs // dims.dp) // dims.cp
    p = Plan(config=name, gpus=dims.world, seq_len=seq_len, batch_seqs=batch_seqs,
             dims={k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "cp", "ep")} | {"efsdp": dims.efsdp},
             recompute=recompute, dtype=dtype, sharded=sharded, params_total=pc.total, rows=rows)
    m = p.memory
    half = dtype == "bfloat16"
    cbytes = 2 if half else 4  # compute dtype
    if sharded:
        f = dims.fsdp
        m["parameters"] = 4.0 * pc.total / f
        m["gradients"] = 4.0 * pc.total / f
        m["optimizer"] = 8.0 * pc.total / f
        unit = pc.unit_dense + pc.unit_experts // dims.ep
        m["gathered units"] = cbytes * (pc.root + 2 * unit)
        # reduce-scatter: the unit's unsharded gradient in the compute dtype and its fp32 copy-in, alive only
        # once the backward has reduced a unit (so not at its start, where the activations peak); all-gather:
        # the shard's compute-dtype copy-in (the output is the gathered unit above)
        reduce_scatter = (cbytes + 4.0) * unit
        m["comm buffers"] = reduce_scatter + cbytes * unit / f
        # gradients are set to None after each step: at the backward's start only the root's and the last
        # block's exist (sharded)
        grads_at_peak = 4.0 * (pc.root + pc.unit_dense + pc.unit_experts // dims.ep) / f
    else:
        small = pc.fp32
        big = pc.total - small
        pbytes = cbytes * big + 4.0 * small
        m["parameters"] = pbytes
        m["gradients"] = pbytes
        m["optimizer"] = 2.0 * pbytes  # torch AdamW's moments in the parameters' dtype
        m["gathered units"] = 0.0
        m["comm buffers"] = 0.0
        reduce_scatter = 0.0
        # gradients are set to None after each step: at the peak (the backward's start) only the head's and
        # the last block's exist
        grads_at_peak = cbytes * (pc.root / (1 if c.tie_word_embeddings else 2) + pc.unit_dense + pc.unit_experts)
    if dims.ep > 1:
        m["comm buffers"] += rows * c.num_experts_per_tok * c.hidden_size * 2.0 * 2
    if dims.cp > 1:  # halo: one window of raw keys, every layer's compressed stream gathered (kept, below)
        m["comm buffers"] += c.sliding_window * (c.hc_mult * c.hidden_size + c.head_dim) * 2.0
    kinds = _layer_kinds(c)
    kept = kept_bytes_per_token(c, recompute)
    act = sum(kept[t] for t in kinds) * rows + kept["model"] * rows
    if dims.cp > 1:  # each rank holds the whole sequence's compressed entries and indexer keys
        seqs = batch_seqs // dims.dp
        a = c.attention_config(0)
        for t in kinds:
            if t == "csa":
                act += seqs * seq_len * (1 - 1 / dims.cp) * (a.head_dim + c.index_head_dim) * 2 / c.compress_rates[
                    "compressed_sparse_attention"]
            elif t == "hca":
                act += seqs * seq_len * (1 - 1 / dims.cp) * a.head_dim * 2 / c.compress_rates[
                    "heavily_compressed_attention"]
    m["activations kept"] = act
    scale = c.hidden_size / _PROXY["D"]
    moe_rows = min(rows, c.moe_chunk_rows)
    m["workspaces"] = (c.workspace_bytes + TRANSIENT["fixed_gib"] * GiB + kept["recompute_extra"] * rows
                       + TRANSIENT["kib_per_token"] * 1024 * scale * rows
                       + max(0, c.num_experts_per_tok - _PROXY["k"]) * 2 * c.hidden_size * 2.0 * moe_rows)
    p.total = sum(m.values())
    # the peak is the backward's start (every kept activation, few gradients, no reduce-scatter yet) or its end
    # (every gradient and the reduce-scatter buffers, the activations freed, the fixed workspaces still held)
    fixed = c.workspace_bytes + TRANSIENT["fixed_gib"] * GiB
    p.peak = p.total - m["gradients"] - m["activations kept"] - m["workspaces"] - reduce_scatter + max(
        m["activations kept"] + m["workspaces"] + grads_at_peak, m["gradients"] + fixed + reduce_scatter)
    p.fits = p.peak <= (1 - HEADROOM) * H200_BYTES
    step_time(p, c, dims, pc)
    return p


def step_time(p: Plan, c: DeepseekV4ModelConfig, dims: ParallelDims, pc: ParamCounts) -> None:
    """Fill ``p.time`` / ``p.step_s``: compute at the measured MFU plus communication.

    Communication model (per rank, ring collectives, ``bytes x (g - 1) / g`` over the slowest link of the group:
    NVLink 900 GB/s when the group lies in one node of 8, InfiniBand 50 GB/s per GPU otherwise):

    - FSDP: per unit two all-gathers (forward, and again for the backward: units reshard after their forward) in
      the compute dtype and one fp32 reduce-scatter; overlapped with compute except the first unit's all-gather
      and the last unit's reduce-scatter, and except what exceeds the compute time; ``dp_replicate`` adds an fp32
      all-reduce of the shard across replicas, overlapped the same way;
    - EP: 4 all-to-alls per MoE layer (dispatch and combine, forward and backward) of ``rows x k x D`` bf16, plus
      2 more when the MoE's forward is recomputed (moe / block / full); not overlapped;
    - CP: the halo and the compressed entries per layer, not overlapped (small).
    """
    seqs = p.batch_seqs // dims.dp
    flops = _seq_flops(c, p.seq_len) * seqs / dims.cp
    mfu = mfu_at(p.rows)
    t = p.time
    t["compute"] = flops / (mfu * PEAK_FLOPS) * RECOMPUTE_SLOWDOWN[p.recompute]
    cb = 2 if p.dtype == "bfloat16" else 4
    t["fsdp exposed"] = t["ep all-to-all"] = t["cp"] = 0.0
    if dims.world > 1:
        f = dims.fsdp
        dense_bw = _bw(f, 1)
        exp_bw = _bw(dims.efsdp, dims.ep)
        ef = dims.efsdp
        per_unit_dense = pc.unit_dense * (f - 1) / f * (2 * cb + 4) / dense_bw
        per_unit_exp = (pc.unit_experts / dims.ep) * (ef - 1) / ef * (2 * cb + 4) / exp_bw
        comm = (pc.dense * (f - 1) / f * (2 * cb + 4)) / dense_bw + pc.blocks * per_unit_exp
        if dims.dp_replicate > 1:
            r = dims.dp_replicate
            comm += 2 * 4.0 * pc.total / f * (r - 1) / r / _bw(r, f)
        first_last = (per_unit_dense + per_unit_exp) * (2 * cb) / (2 * cb + 4) + (
            per_unit_dense + per_unit_exp) * 4 / (2 * cb + 4)
        root = pc.root * (f - 1) / f * cb / dense_bw
        t["fsdp total"] = comm
        t["fsdp exposed"] = root + first_last + max(0.0, comm - t["compute"])
        if dims.ep > 1:
            ep = dims.ep
            exchanges = 4 + (2 if p.recompute in ("moe", "block", "full") else 0)
            vol = p.rows * c.num_experts_per_tok * c.hidden_size * 2.0 * (ep - 1) / ep
            t["ep all-to-all"] = pc.blocks * exchanges * vol / _bw(ep, 1)
        if dims.cp > 1:
            a = c.attention_config(0)
            per_layer = c.sliding_window * a.head_dim * 2.0 * 2 + seqs * p.seq_len / 4 * (
                a.head_dim + c.index_head_dim) * 2.0 * (dims.cp - 1) / dims.cp
            t["cp"] = pc.blocks * 2 * per_layer / _bw(dims.cp, 1)
    p.step_s = t["compute"] + t["fsdp exposed"] + t["ep all-to-all"] + t["cp"]
    p.tokens_per_s = p.seq_len * p.batch_seqs / p.step_s
    p.notes.append(f"compute at {mfu * 100:.1f} % MFU (measured one-GPU proxy), x{RECOMPUTE_SLOWDOWN[p.recompute]:.2f}"
                   f" for recompute {p.recompute}")


def _human(b: float) -> str:
    return f"{b / 1e9:9.2f} GB {b / GiB:9.2f} GiB"


def format_plan(p: Plan) -> str:
    """The per-rank table of one plan."""
    d = p.dims
    mesh = (f"dp_replicate {d['dp_replicate']} x dp_shard {d['dp_shard']} x cp {d['cp']}, ep {d['ep']} "
            f"(efsdp {d['efsdp']})")
    lines = [f"plan: {p.config or 'model'} ({p.params_total / 1e9:.2f} B parameters) on {p.gpus} GPU(s): {mesh}",
             f"  seq_len {p.seq_len}, batch_seqs {p.batch_seqs}, rows per rank {p.rows}, recompute {p.recompute}, "
             f"dtype {p.dtype}, {'FSDP2 (fp32 master weights)' if p.sharded else 'one process, no FSDP'}",
             "  per rank:"]
    for k, v in p.memory.items():
        lines.append(f"    {k:<18}{_human(v)}")
    lines.append(f"    {'total':<18}{_human(p.total)}   (every gradient alive at once)")
    limit = (1 - HEADROOM) * H200_BYTES
    lines.append(f"peak (predicted): {p.peak / GiB:.2f} GiB  ({p.peak / 1e9:.2f} GB; the larger of the backward's "
                 "start, few gradients alive, and its end, no activations)")
    lines.append(f"peak beyond weights/grads/optimizer (predicted): "
                 f"{(p.memory['activations kept'] + p.memory['workspaces']) / GiB:.2f} GiB "
                 "(benchmarks.run --op model's GiB column)")
    lines.append(f"fit: {'yes' if p.fits else 'NO'} (H200 141 GB, {HEADROOM * 100:.0f} % left to the allocator: "
                 f"limit {limit / 1e9:.1f} GB)")
    t = p.time
    parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items())
    lines.append(f"step time (estimated): {p.step_s * 1e3:.1f} ms ({parts}); {p.tokens_per_s / 1e3:.1f}k tokens/s, "
                 f"{p.tokens_per_s / p.gpus / 1e3:.2f}k tokens/s/GPU")
    lines.extend(f"  note: {n}" for n in p.notes)
    return "\n".join(lines)


def _pow2_divisors(x: int) -> list[int]:
    return [d for d in (2**i for i in range(0, 20)) if d <= x and x % d == 0]


def search(c: DeepseekV4ModelConfig, gpus: int, seq_len: int, *, rows_target: int = 16384,
           name: str = "") -> Plan | None:
    """The mesh and recompute for ``gpus`` at ``seq_len``: among the plans that fit, the fastest (tokens/s), ties
    within 2 % to the smaller peak memory. Each replica reads ``max(1, rows_target // seq_len)`` sequences.
    ``None`` when nothing fits."""
    best = None
    per_replica = max(1, rows_target // seq_len)
    for cp in _pow2_divisors(gpus):
        if seq_len % cp or seq_len // cp < 1024:
            continue
        for r in _pow2_divisors(gpus // cp):
            s = gpus // cp // r
            for ep in _pow2_divisors(s * cp):
                if c.n_routed_experts % ep:
                    continue
                dims = ParallelDims(dp_replicate=r, dp_shard=s, cp=cp, ep=ep, world=gpus)
                for rc in RECOMPUTE_CHOICES:
                    try:
                        p = plan(c, dims, seq_len, batch_seqs=r * s * per_replica, recompute=rc, name=name)
                    except ValueError:
                        continue
                    if not p.fits:
                        continue
                    if best is None or p.tokens_per_s > best.tokens_per_s * 1.02 or (
                            p.tokens_per_s > best.tokens_per_s / 1.02 and p.peak < best.peak):
                        best = p
    return best


def load_config(path: str) -> DeepseekV4ModelConfig:
    with open(path) as fh:
        return DeepseekV4ModelConfig.from_hf(json.load(fh))


def docs_table(configs: list[tuple[str, str]] = (("V4-Flash", "benchmarks/configs/v4_flash.json"),
                                                  ("V4-Pro", "benchmarks/configs/v4_pro.json")),
               seq_lens: tuple[int, ...] = (4096, 65536, 1048576),
               gpus: tuple[int, ...] = (8, 16, 32, 64, 128, 256)) -> str:
    """Markdown: each model x sequence length x GPU count, the mesh and recompute :func:`search` picks."""
    out = ["# Planner: V4-Flash and V4-Pro on H200s", "",
           "Generated by `python -m csattn.parallel.plan --table > docs/plan.md` (no GPU). Each cell: the mesh "
           "(R = dp_replicate, S = dp_shard, C = cp, E = ep) and recompute `csattn plan` picks among those that fit "
           "(the fastest; within 2 % the smaller memory), its predicted per-rank peak in GB and estimated step time; "
           "each data replica reads max(1, 16384 / seq_len) sequences. Fit: peak <= 95 % of the H200's 141 GB (5 % "
           "left to the allocator). Memory: fp32 master weights, gradients and AdamW state sharded by FSDP2, bf16 "
           "compute copies of the root and two units in flight, kept activations from the measured bytes per token "
           "per layer (`csattn/parallel/plan.py` `KEPT_KIB`). Time: `model_flops` at the proxy's measured one-GPU MFU "
           "(42-44 %) x the recompute's measured slow-down, FSDP collectives overlapped except the first / last unit "
           "and the root, EP all-to-all not overlapped (NVLink 900 GB/s in a node of 8, InfiniBand 50 GB/s per GPU "
           "across nodes). Estimates, not measurements.", ""]
    for label, path in configs:
        c = load_config(path)
        pc = count_params(c)
        out += [f"## {label} ({pc.total / 1e9:.0f} B parameters, {pc.experts / 1e9:.0f} B in routed experts)", "",
                "| tokens / seq | " + " | ".join(f"{g} GPUs" for g in gpus) + " |",
                "| ---: | " + " | ".join("---" for _ in gpus) + " |"]
        for L in seq_lens:
            cells = []
            for g in gpus:
                p = search(c, g, L, name=label)
                if p is None:
                    cells.append("does not fit")
                else:
                    d = p.dims
                    cells.append(f"R{d['dp_replicate']} S{d['dp_shard']} C{d['cp']} E{d['ep']}, {p.recompute}: "
                                 f"{p.peak / 1e9:.0f} GB, {p.step_s:.2f} s ({p.batch_seqs} seq)")
            label_len = f"{L // 1024}k" if L < 1048576 else f"{L // 1048576}M"
            out.append(f"| {label_len} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="HF config.json of the model")
    p.add_argument("--gpus", type=int, default=1, help="world size (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=16384, help="tokens per packed sequence (default %(default)s)")
    p.add_argument("--batch-seqs", type=int, default=None, help="sequences per global step (default: one per "
                   "data replica)")
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--dp-shard", type=int, default=-1, help="-1: what the other sizes leave of --gpus")
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--recompute", choices=RECOMPUTE_CHOICES, default="none")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--search", action="store_true", help="pick the mesh and recompute (ignores the mesh flags)")
    p.add_argument("--table", action="store_true", help="print docs/plan.md (V4-Flash, V4-Pro)")


def run_plan(args: argparse.Namespace) -> int:
    if args.table:
        print(docs_table())
        return 0
    if not args.config:
        raise SystemExit("csattn plan: --config is required (or --table)")
    c = load_config(args.config)
    name = args.config.rsplit("/", 1)[-1].removesuffix(".json")
    if args.search:
        p = search(c, args.gpus, args.seq_len, name=name)
        if p is None:
            print(f"does not fit: no mesh of {args.gpus} GPUs fits {args.seq_len} tokens per sequence")
            return 1
    else:
        dims = ParallelDims(dp_replicate=args.dp_replicate, dp_shard=args.dp_shard, cp=args.cp, ep=args.ep,
                            world=args.gpus)
        p = plan(c, dims, args.seq_len, batch_seqs=args.batch_seqs, recompute=args.recompute, dtype=args.dtype,
                 name=name)
    print(json.dumps(asdict(p), indent=1) if args.json else format_plan(p))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m csattn.parallel.plan", description=__doc__.splitlines()[0])
    add_plan_args(parser)
    try:
        return run_plan(parser.parse_args(argv))
    except ValueError as e:
        parser.error(str(e))
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
