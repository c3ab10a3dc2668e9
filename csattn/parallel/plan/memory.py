"""Per-rank memory of one mesh (:func:`plan`): weights by storage dtype, gradients and AdamW state for what trains,
the FSDP units in flight, kept activations and the backward's workspaces; the peak that decides the fit."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ...models.deepseek_v4.config import RECOMPUTE_CHOICES, DeepseekV4ModelConfig
from ...ops.fp8.grouped import input_grad_copies
from ..mesh import ParallelDims
from .counts import GROUPS, GroupCount, Training, cached, count_groups, layer_kinds
from .measured import KEPT_KIB, TRANSIENT
from .records import GiB, Memory, Part, Plan, Sizes
from .timing import step_time

__all__ = ["FP8_BYTES", "fp8_workspace", "kept_bytes_per_token", "plan", "sizes"]

FP8_BYTES = 1 + 4 / (128 * 128)  # e4m3 plus one fp32 scale per 128x128 block, per element
FP8_ACT_BYTES = 1 + 4 / 128  # e4m3 plus one fp32 scale per 1x128 tile (activations)

# the geometry KEPT_KIB (measured.py) was measured at: the 4-layer proxy at 16k tokens, recompute none
PROXY = {"D": 4096, "n": 4, "k": 2, "I": 2048, "ql": 1024, "topk": 512}


def kept_bytes_per_token(c: DeepseekV4ModelConfig, recompute: str,
                         kept_kib: Mapping[str, float] = KEPT_KIB) -> dict[str, float]:
    """Bytes per token of the rank kept for the backward, by layer kind and per model, for ``recompute``:
    ``{"sliding"|"csa"|"hca": per layer, "model": embedding + heads, "recompute_extra": one layer's state alive
    while it is recomputed}``, scaled by the geometry from ``kept_kib`` (the proxy's measured KiB per token per
    layer by component, :data:`KEPT_KIB` unless another measurement is given)."""
    K, p, kib = 1024.0, PROXY, kept_kib
    D, n, k, I = c.hidden_size, c.hc_mult, c.num_experts_per_tok, c.moe_intermediate_size
    ql, topk = c.q_lora_rank, c.index_topk
    combines = kib["combines"] * K * (n * D) / (p["n"] * p["D"])
    moe = (k * 2 * I * 2 + 2 * I * 2 + D * 2) + (kib["moe"] - 32.0) * K * k / p["k"]
    out = D * 2.0
    topk_part = 6.0 * K * topk / p["topk"]
    attn = {"sliding": (kib["attn_sliding"] - 8.0) * K * ql / p["ql"] + out,
            "csa": (kib["attn_csa"] - 14.0) * K * ql / p["ql"] + topk_part + out,
            "hca": (kib["attn_hca"] - 8.0) * K * ql / p["ql"] + out}
    mhc = kib["mhc"] * K
    heads = 1 + c.num_nextn_predict_layers
    model = (kib["embed"] + kib["head"] * heads) * K * D / p["D"]
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


def _part(groups: dict[str, GroupCount], t: Training, cbytes: int, experts: bool) -> Part:
    tr = sm = fr = 0.0
    for g, v in groups.items():
        if (g == "experts") != experts:
            continue
        if g in t.train:
            tr += v.matrix
            sm += v.small
        else:
            fr += v.matrix * (FP8_BYTES if t.fp8(g) else cbytes) + 4.0 * v.small
        if g in t.lora_targets:
            tr += t.lora_rank * v.lora
    return Part(tr, sm, fr)


def _max_part(parts: list[Part]) -> Part:
    return Part(max(p.trained for p in parts), max(p.trained_small for p in parts), max(p.frozen for p in parts))


def sizes(c: DeepseekV4ModelConfig, t: Training, cbytes: int) -> Sizes:
    """The trained elements and frozen bytes of ``c`` under ``t`` (frozen matrices at ``cbytes`` unless FP8)."""
    def build() -> Sizes:
        gc = count_groups(c)
        tot = gc.total()
        dense = [_part(b, t, cbytes, False) for b in gc.blocks]
        exp = [_part(b, t, cbytes, True) for b in gc.blocks]
        head = "embed" if c.tie_word_embeddings else "head"
        head_tr = gc.root[head].matrix if head in t.train else 0.0
        return Sizes(dense=_part(tot, t, cbytes, False), experts=_part(tot, t, cbytes, True),
                     unit_dense=_max_part(dense), unit_experts=_max_part(exp),
                     root=_part(gc.root, t, cbytes, False), head_trained=head_tr, blocks=len(gc.blocks))

    return cached(c, "sizes", (t, cbytes), build)


def _resolve(c: DeepseekV4ModelConfig, dims: ParallelDims, seq_len: int, batch_seqs: int | None, recompute: str,
             dtype: str) -> tuple[ParallelDims, int]:
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
    if c.n_routed_experts % dims.ep:
        raise ValueError(f"--ep {dims.ep} must divide the {c.n_routed_experts} routed experts")
    batch_seqs = dims.dp if batch_seqs is None else batch_seqs
    if batch_seqs < 1 or batch_seqs % dims.dp:
        raise ValueError(f"--batch-seqs {batch_seqs} must be a positive multiple of the {dims.dp} data replicas "
                         "(--dp-replicate x --dp-shard)")
    if seq_len % dims.cp:
        raise ValueError(f"--seq-len {seq_len} must be divisible by --cp {dims.cp}")
    return dims, batch_seqs


def plan(c: DeepseekV4ModelConfig, dims: ParallelDims, seq_len: int, *, batch_seqs: int | None = None,
         recompute: str = "none", dtype: str = "bfloat16", name: str = "", training: Training | None = None) -> Plan:
    """Per-rank memory and step time of training ``c`` on ``dims`` (resolved here; ``ValueError`` naming the flag).

    Args:
        seq_len: tokens per packed sequence. batch_seqs: sequences per global step (default: one per data
            replica). recompute: one of ``RECOMPUTE_CHOICES``. dtype: ``bfloat16`` or ``float32``.
        training: what trains (default: everything, :class:`Training`).
    """
    t = Training() if training is None else training
    dims, batch_seqs = _resolve(c, dims, seq_len, batch_seqs, recompute, dtype)
    if t.fp8("experts"):
        dims.check_fp8_experts()  # the trainer's check
    cb = 2 if dtype == "bfloat16" else 4  # compute dtype
    sz = sizes(c, t, cb)
    rows = seq_len * (batch_seqs // dims.dp) // dims.cp
    trained = sz.dense.train_elems + sz.experts.train_elems
    lora = sum(t.lora_rank * v.lora for g, v in cached(c, "totals", 0, lambda: count_groups(c).total()).items()
               if g in t.lora_targets)
    p = Plan(config=name, gpus=dims.world, seq_len=seq_len, batch_seqs=batch_seqs,
             dims={k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "cp", "ep")} | {"efsdp": dims.efsdp},
             recompute=recompute, dtype=dtype, sharded=dims.world > 1,
             params_total=cached(c, "total", 0, lambda: sum(v.params for v in count_groups(c).total().values())),
             rows=rows, params_trained=int(trained), params_lora=int(lora),
             training={"train": [g for g in GROUPS if g in t.train], "lora_rank": t.lora_rank,
                       "lora_targets": [g for g in GROUPS if g in t.lora_targets], "base_precision": t.base_precision,
                       "fp8_linears": t.fp8_linears, "fp8": [g for g in GROUPS if t.fp8(g)]})
    weights, grads_at_peak, reduce_scatter = _weights(p, c, dims, sz, cb)
    kept, workspaces = _activations(p, c, dims)
    p.memory = replace(weights, activations_kept=kept, workspaces=workspaces,
                       fp8_workspace=fp8_workspace(c, rows, t, dims.ep))
    _peak(p, c, grads_at_peak, reduce_scatter)
    step_time(p, c, dims, sz, t)
    return p


def _weights(p: Plan, c: DeepseekV4ModelConfig, dims: ParallelDims, sz: Sizes,
             cb: int) -> tuple[Memory, float, float]:
    """The weight terms of the memory; the gradients alive at the backward's start; the reduce-scatter buffers
    alive at its end."""
    trained = sz.dense.train_elems + sz.experts.train_elems
    if p.sharded:
        f, ep, ef = dims.fsdp, dims.ep, dims.efsdp

        def gathered(x: Part, group: int) -> float:  # bf16 copies of what trains; frozen weights as held
            return cb * x.train_elems + (x.frozen if group > 1 else 0.0)

        unit_tr = sz.unit_dense.train_elems + sz.unit_experts.train_elems / ep
        # reduce-scatter: the unit's unsharded gradient in the compute dtype and its fp32 copy-in, alive only
        # once the backward has reduced a unit (so not at its start, where the activations peak); all-gather:
        # the shard's copy-in (the output is the gathered unit above)
        reduce_scatter = (cb + 4.0) * unit_tr
        m = Memory(parameters=(4.0 * trained + sz.dense.frozen + sz.experts.frozen) / f,
                   gradients=4.0 * trained / f, optimizer=8.0 * trained / f,
                   gathered_units=gathered(sz.root, f) + 2 * (gathered(sz.unit_dense, f)
                                                              + gathered(sz.unit_experts, ef) / ep),
                   comm_buffers=reduce_scatter + (cb * unit_tr + sz.unit_dense.frozen
                                                  + sz.unit_experts.frozen / ep) / f)
        # gradients are set to None after each step: at the backward's start only the root's and the last
        # block's exist (sharded)
        grads_at_peak = 4.0 * (sz.root.train_elems + unit_tr) / f
    else:
        pbytes = cb * (sz.dense.trained + sz.experts.trained) + 4.0 * (sz.dense.trained_small
                                                                       + sz.experts.trained_small)
        m = Memory(parameters=pbytes + sz.dense.frozen + sz.experts.frozen, gradients=pbytes,
                   optimizer=2.0 * pbytes)  # torch AdamW's moments in the parameters' dtype
        reduce_scatter = 0.0
        # at the peak (the backward's start) only the head's and the last block's gradients exist
        grads_at_peak = cb * (sz.head_trained + sz.unit_dense.train_elems + sz.unit_experts.train_elems)
    comm = m.comm_buffers
    if dims.ep > 1:
        comm += p.rows * c.num_experts_per_tok * c.hidden_size * 2.0 * 2
    if dims.cp > 1:  # halo: one window of raw keys, every layer's compressed stream gathered (kept, below)
        comm += c.sliding_window * (c.hc_mult * c.hidden_size + c.head_dim) * 2.0
    return replace(m, comm_buffers=comm), grads_at_peak, reduce_scatter


def _activations(p: Plan, c: DeepseekV4ModelConfig, dims: ParallelDims) -> tuple[float, float]:
    """Bytes of the kept activations and of the backward's workspaces."""
    rows = p.rows
    kinds = layer_kinds(c)
    kept = kept_bytes_per_token(c, p.recompute)
    act = sum(kept[k] for k in kinds) * rows + kept["model"] * rows
    if dims.cp > 1:  # each rank holds the whole sequence's compressed entries and indexer keys
        seqs = p.batch_seqs // dims.dp
        a = c.attention_config(0)
        rates = c.compress_rates
        for k in kinds:
            if k == "csa":
                act += (seqs * p.seq_len * (1 - 1 / dims.cp) * (a.head_dim + c.index_head_dim) * 2
                        / rates["compressed_sparse_attention"])
            elif k == "hca":
                act += seqs * p.seq_len * (1 - 1 / dims.cp) * a.head_dim * 2 / rates["heavily_compressed_attention"]
    scale = c.hidden_size / PROXY["D"]
    moe_rows = min(rows, c.moe_chunk_rows)
    workspaces = (c.workspace_bytes + TRANSIENT["fixed_gib"] * GiB + kept["recompute_extra"] * rows
                  + TRANSIENT["kib_per_token"] * 1024 * scale * rows
                  + max(0, c.num_experts_per_tok - PROXY["k"]) * 2 * c.hidden_size * 2.0 * moe_rows)
    return act, workspaces


def fp8_workspace(c: DeepseekV4ModelConfig, rows: int, t: Training, ep: int = 1) -> float:
    """Bytes alive while frozen FP8-held weights are multiplied, in one layer's backward. Routed experts (the
    grouped kernels read the codes as held: the Gluon kernel transposes each weight tile in shared memory for the
    input gradient, the weight-only kernel casts it in registers): ``fp8``: the 1x128-quantized copies of the
    GEMMs' inputs and output gradients on a MoE chunk of rows, and where the rank's experts get
    ``COPY_ROWS_PER_EXPERT`` rows each (routing balanced over ``ep`` ranks) the K-major copy of its ``E / ep``
    experts' gate / up weights that the input gradient multiplies instead; ``w8a16``: none. Dense groups
    (``fp8_linear``): the largest attention matrix ``[H d, max(q_lora, o_lora)]``, ``fp8``: its transposed FP8 copy
    for the input gradient (cuBLAS reads K-major operands) and the quantized activations of the rank's rows at width
    ``D``; ``w8a16``: its bf16 dequantized copy."""
    D, I, k = c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok
    out = 0.0
    if t.fp8("experts") and t.base_precision == "fp8":
        moe_rows = min(rows, c.moe_chunk_rows) * k
        out = moe_rows * (D + 2 * I) * FP8_ACT_BYTES
        local = c.n_routed_experts // ep
        if input_grad_copies(moe_rows, local):  # gate / up's copy, the larger (down's is freed before it is made)
            out += local * 2 * I * D * FP8_BYTES
    if any(t.fp8(g) for g in ("attention", "indexer", "compressor", "shared_experts")):
        w = c.num_attention_heads * c.head_dim * max(c.q_lora_rank, c.o_lora_rank)
        out += (w * FP8_BYTES + rows * D * 2 * FP8_ACT_BYTES if t.base_precision == "fp8" else w * 2.0)
    return out


def _peak(p: Plan, c: DeepseekV4ModelConfig, grads_at_peak: float, reduce_scatter: float) -> None:
    """The peak is the backward's start (every kept activation, few gradients, no reduce-scatter yet) or its end
    (every gradient and the reduce-scatter buffers, the activations freed, the fixed workspaces still held)."""
    m = p.memory
    p.total = m.total
    fixed = c.workspace_bytes + TRANSIENT["fixed_gib"] * GiB
    base = p.total - m.gradients - m.activations_kept - m.workspaces - reduce_scatter
    start = m.activations_kept + m.workspaces + grads_at_peak
    end = m.gradients + fixed + reduce_scatter
    p.peak = base + max(start, end)
    p.peak_at = "the backward's start" if start >= end else "the backward's end"
    p.fits = p.peak <= p.limit
