"""Parameter counts from the geometry: the whole model by kind (:func:`count_params`) and by fine-tuning group
(:func:`count_groups`: stored elements, multiply-adds per token, LoRA's ``in + out`` per adapted map), and what a
run trains (:class:`Training`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...models.deepseek_v4.checkpoint import BASE_PRECISIONS
from ...models.deepseek_v4.config import DeepseekV4ModelConfig
from ...models.deepseek_v4.groups import DEFAULT_LORA_TARGETS, GROUPS, LORA_GROUPS, group_of

__all__ = ["GROUPS", "FP8_GROUPS", "BASE_PRECISIONS", "DEFAULT_LORA_TARGETS", "ParamCounts",
           "GroupCount", "GroupCounts", "Training", "count_params", "count_groups", "flop_counts", "group_of",
           "training_spec"]

# Groups whose matrices the release stores in FP8 (128x128 block scales) and a frozen base may keep in FP8; the
# router, mHC, embedding and head stay bf16 / fp32.
FP8_GROUPS = frozenset({"attention", "indexer", "compressor", "shared_experts", "experts"})


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


@dataclass(frozen=True)
class GroupCount:
    """One group's share of a block (or of the root). ``matrix`` / ``small``: stored elements of its matrices
    (bf16- or FP8-held) and of its vectors (norms, sinks, position biases, mHC: fp32); ``macs``: matrix
    multiply-adds per token (the forward's FLOPs / 2); ``lora``: sum of ``in + out`` over its adapted linear maps
    (times the rank: the LoRA parameters); ``lora_macs``: the same over the maps whose LoRA runs factored per token
    (``x A^T B^T``: a linear called as a module, the routed experts' pairs for the ``k`` a token runs; times the
    rank: its multiply-adds per token; the projections the layer reads run their pairs factored too,
    :class:`~csattn.layers.modules.Projection`)."""

    matrix: int = 0
    small: int = 0
    macs: int = 0
    lora: int = 0
    lora_macs: int = 0

    def __add__(self, o: GroupCount) -> GroupCount:
        return GroupCount(self.matrix + o.matrix, self.small + o.small, self.macs + o.macs, self.lora + o.lora,
                          self.lora_macs + o.lora_macs)

    @property
    def params(self) -> int:
        return self.matrix + self.small


@dataclass(frozen=True)
class GroupCounts:
    """:class:`GroupCount` by group for every decoder / MTP block (an FSDP unit each) and for the root (embedding,
    final norm and hyper-head, LM head)."""

    blocks: list[dict[str, GroupCount]]
    root: dict[str, GroupCount]

    def total(self) -> dict[str, GroupCount]:
        out = {g: GroupCount() for g in GROUPS}
        for part in (*self.blocks, self.root):
            for g, v in part.items():
                out[g] = out[g] + v
        return out


def _attention_groups(c: DeepseekV4ModelConfig, i: int) -> dict[str, GroupCount]:
    a = c.attention_config(i)
    D, H, d, ql, g, ol = a.hidden_size, a.num_heads, a.head_dim, a.q_lora_rank, a.o_groups, a.o_lora_rank
    Hd = H * d
    mat = D * ql + ql * Hd + D * d + ol * Hd + D * g * ol
    # o_a_proj is block-diagonal [g o_lora, H*d/g]: its pair is A [r, H*d/g] (every group's input runs through it:
    # H*d multiply-adds a token per rank) and B [g o_lora, r]
    io = (D + ql) + (ql + Hd) + (D + d) + (Hd // g + g * ol) + (g * ol + D)
    macs = (D + ql) + (ql + Hd) + (D + d) + (Hd + g * ol) + (g * ol + D)  # all five run factored
    out = {"attention": GroupCount(mat, H + ql + d, mat, io, macs)}
    if a.layer_type == "csa":
        r, HI, cI = a.compress_ratio, a.index_n_heads, a.index_head_dim
        m = 2 * 2 * d * D
        out["compressor"] = GroupCount(m, r * 2 * d + d, m, 2 * (D + 2 * d), 2 * (D + 2 * d))
        m = 2 * 2 * cI * D + HI * cI * ql + HI * D
        io = 2 * (D + 2 * cI) + (ql + HI * cI) + (D + HI)
        out["indexer"] = GroupCount(m, r * 2 * cI + cI, m, io, io)  # every pair factored (q_b_proj's read)
    elif a.layer_type == "hca":
        m = 2 * d * D
        out["compressor"] = GroupCount(m, a.compress_ratio * d + d, m, 2 * (D + d), 2 * (D + d))
    return out


def _block_groups(c: DeepseekV4ModelConfig, i: int) -> dict[str, GroupCount]:
    D, n, E, k, I = c.hidden_size, c.hc_mult, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size
    hc_site = (2 + n) * n * n * D + (2 + n) * n + 3
    hc_head = n * n * D + n + 1
    out = _attention_groups(c, i)
    out["router"] = GroupCount(E * D, 0, E * D, D + E, D + E)
    # factored through the grouped GEMMs, gate and up as one pair of rank 2r (B block-diagonal): 2D + 4I, then I + D
    out["shared_experts"] = GroupCount(3 * D * I, 0, 3 * D * I, 3 * (D + I), 3 * D + 5 * I)
    # per expert: gate_up [2I, D] and down [D, I], one adapter pair each; k experts per token
    out["experts"] = GroupCount(E * 3 * D * I, 0, k * 3 * D * I, E * (3 * I + 2 * D), k * (3 * I + 2 * D))
    mhc_macs = 2 * (2 + n) * n * n * D
    if i < c.num_hidden_layers:
        out["mhc"] = GroupCount(0, 2 * hc_site + 2 * D, mhc_macs)
        return out
    # MTP block: its hyper-head; e_proj on the embedding, h_proj on every stream, three norms. LoRA adapts the
    # decoder layers only (csattn.finetune.lora): an MTP block has no LoRA counts
    out["mhc"] = GroupCount(0, 2 * hc_site + 2 * D + hc_head, mhc_macs + n * n * D)
    out["head"] = GroupCount(2 * D * D, 3 * D, D * D + n * D * D)
    return {g: GroupCount(v.matrix, v.small, v.macs) for g, v in out.items()}


def count_groups(c: DeepseekV4ModelConfig) -> GroupCounts:
    """Every block's and the root's parameters, multiply-adds and LoRA sizes by fine-tuning group."""
    D, n, V = c.hidden_size, c.hc_mult, c.vocab_size
    heads = 1 + c.num_nextn_predict_layers  # the LM head runs once per head (decoder and each MTP block)
    blocks = [_block_groups(c, i) for i in range(c.num_hidden_layers + c.num_nextn_predict_layers)]
    head_mat = 0 if c.tie_word_embeddings else V * D
    root = {"embed": GroupCount(V * D, 0, 0, V + D, D),
            "head": GroupCount(head_mat, D, heads * V * D, D + V, heads * (D + V)),
            "mhc": GroupCount(0, n * n * D + n + 1, n * n * D)}
    return GroupCounts(blocks=blocks, root=root)


@dataclass(frozen=True)
class Training:
    """What a run trains. ``train``: groups trained in full; the others are frozen (no gradient, no optimizer
    state, no reduce-scatter, no weight-gradient GEMM), their matrices held as ``base_precision`` says (``fp8``:
    FP8 e4m3 with one fp32 scale per 128x128 block, multiplied in FP8; ``w8a16``: held so, dequantized to bf16 to
    multiply; ``bf16``): the routed experts, and with ``fp8_linears`` the dense groups of :data:`FP8_GROUPS` that
    LoRA does not adapt (the trainer's ``--fp8-linears``); bf16 otherwise. ``lora_rank`` > 0 adds LoRA pairs of that
    rank on the frozen groups in ``lora_targets``."""

    train: frozenset[str] = frozenset(GROUPS)
    lora_rank: int = 0
    lora_targets: frozenset[str] = field(default_factory=frozenset)
    base_precision: str = "fp8"
    fp8_linears: bool = False

    @property
    def full(self) -> bool:
        return self.train == frozenset(GROUPS) and not self.lora_rank

    def fp8(self, group: str) -> bool:
        """Whether ``group``'s matrices are held in FP8 (frozen, an FP8 base; the routed experts, or with
        ``fp8_linears`` a dense FP8 group without LoRA: as ``csattn train`` holds them)."""
        if group in self.train or self.base_precision == "bf16":
            return False
        return group == "experts" or (self.fp8_linears and group in FP8_GROUPS and group not in self.lora_targets)


def _groups_arg(flag: str, value: Any) -> frozenset[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    items = [s.strip() for s in items if s.strip()]
    bad = [s for s in items if s not in GROUPS]
    if bad:
        raise ValueError(f"{flag}: unknown group(s) {', '.join(bad)}; the groups are {','.join(GROUPS)}")
    return frozenset(items)


def training_spec(*, lora_rank: int = 0, lora_targets: Any = None, train: Any = None, freeze: Any = None,
                  base_precision: str | None = None, fp8_linears: bool = False) -> Training:
    """A :class:`Training` from the flags (``ValueError`` naming the flag). Defaults: every group trained; with
    ``--lora-rank`` > 0 every group frozen (routed experts in FP8) and LoRA on attention, indexer, shared experts
    and routed experts; ``--base-precision fp8``, routed experts only in FP8 (``--fp8-linears``: the frozen dense
    groups without LoRA too). Groups: comma-separated names of :data:`GROUPS`."""
    if lora_rank < 0:
        raise ValueError(f"--lora-rank must be >= 0, got {lora_rank}")
    if train is not None and freeze is not None:
        raise ValueError("--train and --freeze exclude each other: name the trained groups or the frozen ones")
    if train is not None:
        trained = _groups_arg("--train", train)
    elif freeze is not None:
        trained = frozenset(GROUPS) - _groups_arg("--freeze", freeze)
    else:
        trained = frozenset() if lora_rank else frozenset(GROUPS)
    if not trained and not lora_rank:
        raise ValueError("nothing trains: every group is frozen and --lora-rank is 0")
    if lora_targets is not None and not lora_rank:
        raise ValueError("--lora-targets needs --lora-rank > 0")
    targets = (_groups_arg("--lora-targets", lora_targets) if lora_targets is not None
               else frozenset(DEFAULT_LORA_TARGETS) if lora_rank else frozenset())
    if targets & trained:
        raise ValueError(f"--lora-targets {','.join(sorted(targets & trained))} also trained in full: LoRA goes on "
                         "frozen groups (drop them from --train or from --lora-targets)")
    if targets - set(LORA_GROUPS):
        bad = ",".join(g for g in GROUPS if g in targets and g not in LORA_GROUPS)
        raise ValueError(f"--lora-targets {bad}: LoRA adapts the linear maps of {','.join(LORA_GROUPS)} only (as "
                         f"csattn train); train {bad} in full (--train {bad}) or leave it frozen")
    precision = "fp8" if base_precision is None else base_precision
    if precision not in BASE_PRECISIONS:
        raise ValueError(f"--base-precision must be one of {', '.join(BASE_PRECISIONS)}, got {precision!r}")
    if fp8_linears and precision == "bf16":
        raise ValueError("--fp8-linears holds frozen dense linears in FP8: it needs --base-precision fp8 or w8a16")
    return Training(train=trained, lora_rank=lora_rank, lora_targets=targets, base_precision=precision,
                    fp8_linears=fp8_linears)


def flop_counts(c: DeepseekV4ModelConfig, t: Training, fp8_held: bool = True) -> dict[str, float]:
    """What one step of ``t`` runs beside the full model's FLOPs, per token: the keyword arguments of
    :func:`~csattn.models.deepseek_v4.flops.finetune_flops` from the groups' counts. ``frozen_macs``: the frozen
    groups' multiply-adds (no weight gradient); ``fp8_macs``: those held in FP8 (``fp8_held``; False: none, for a
    weight-only base that multiplies in bf16); ``lora_rank``; ``lora_io``: the adapted maps' multiply-adds per token
    and rank (all run factored)."""
    groups = cached(c, "totals", 0, lambda: count_groups(c).total())
    lora = [v for g, v in groups.items() if g in t.lora_targets] if t.lora_rank else []
    return {"frozen_macs": sum(v.macs for g, v in groups.items() if g not in t.train),
            "fp8_macs": sum(v.macs for g, v in groups.items() if fp8_held and t.fp8(g)),
            "lora_rank": t.lora_rank, "lora_io": sum(v.lora_macs for v in lora)}


_CACHE: dict[tuple[int, str, Any], tuple[DeepseekV4ModelConfig, Any]] = {}


def cached(c: DeepseekV4ModelConfig, what: str, key: Any, fn: Any) -> Any:
    """``fn()`` once per config object (held, so its id is not reused) and key: the search plans hundreds of meshes."""
    k = (id(c), what, key)
    hit = _CACHE.get(k)
    if hit is None or hit[0] is not c:
        hit = _CACHE[k] = (c, fn())
    return hit[1]


def layer_kinds(c: DeepseekV4ModelConfig) -> list[str]:
    n = c.num_hidden_layers
    return cached(c, "kinds", 0, lambda: [c.attention_config(i).layer_type
                                          for i in range(n + c.num_nextn_predict_layers)])
