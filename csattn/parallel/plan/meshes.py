"""The search over meshes and recompute (:func:`search`, :func:`rank_plans`), what would fit when nothing does
(:func:`nearest_fits`), and the docs table (:func:`docs_table`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ...models.deepseek_v4.config import RECOMPUTE_CHOICES, DeepseekV4ModelConfig
from ..mesh import ParallelDims
from .counts import Training, count_params, training_spec
from .load import load_config
from .measured import FP8_GEMM_SPEEDUP, MFU_BY_ROWS
from .memory import plan
from .records import H200_BYTES, HEADROOM, LIMIT_BYTES, GiB, Plan

__all__ = ["MESH_FLAGS", "Ranked", "Suggestion", "docs_table", "nearest_fits", "pick", "rank_plans", "runner_ups",
           "search"]

MESH_FLAGS = ("dp_replicate", "dp_shard", "cp", "ep")
MIN_ROWS_PER_CP_RANK = 1024  # the search splits a sequence no finer (a fixed --cp is taken as given)


def _pow2_divisors(x: int) -> list[int]:
    return [d for d in (2**i for i in range(0, 20)) if d <= x and x % d == 0]


def _meshes(c: DeepseekV4ModelConfig, gpus: int, seq_len: int, mesh: dict[str, int]) -> Iterator[ParallelDims]:
    """Every mesh of ``gpus`` (sizes powers of two unless fixed in ``mesh``) that takes the fixed sizes."""
    if gpus == 1:
        yield ParallelDims(world=1)
        return
    for cp in [mesh["cp"]] if "cp" in mesh else _pow2_divisors(gpus):
        if "cp" not in mesh and (seq_len % cp or seq_len // cp < MIN_ROWS_PER_CP_RANK):
            continue
        for r in [mesh["dp_replicate"]] if "dp_replicate" in mesh else _pow2_divisors(gpus // cp):
            if gpus % (cp * r):
                continue
            s = gpus // cp // r
            if mesh.get("dp_shard", -1) not in (-1, s):
                continue
            for ep in [mesh["ep"]] if "ep" in mesh else _pow2_divisors(s * cp):
                if "ep" not in mesh and c.n_routed_experts % ep:
                    continue
                yield ParallelDims(dp_replicate=r, dp_shard=s, cp=cp, ep=ep, world=gpus)


@dataclass
class Ranked:
    """The plans that fit, best first (the fastest; within 2 % the smaller peak), the smallest peak of all
    (fitting or not), how many plans were valid, and the last refusal when none was."""

    fitting: list[Plan] = field(default_factory=list)
    smallest: Plan | None = None
    valid: int = 0
    refusal: str = ""


def rank_plans(c: DeepseekV4ModelConfig, gpus: int, seq_len: int, *, batch_seqs: int | None = None,
               recompute: str | None = None, dtype: str = "bfloat16", mesh: dict[str, int] | None = None,
               training: Training | None = None, rows_target: int = 16384, name: str = "") -> Ranked:
    """Every mesh of ``gpus`` and recompute that takes the given flags (``mesh``: fixed sizes of
    :data:`MESH_FLAGS`; ``batch_seqs`` / ``recompute`` fixed when given). Without ``batch_seqs`` each data
    replica reads ``max(1, rows_target // seq_len)`` sequences."""
    out = Ranked()
    per_replica = max(1, rows_target // seq_len)
    for dims in _meshes(c, gpus, seq_len, mesh or {}):
        for rc in [recompute] if recompute is not None else RECOMPUTE_CHOICES:
            bs = batch_seqs if batch_seqs is not None else dims.dp_replicate * max(dims.dp_shard, 1) * per_replica
            try:
                p = plan(c, dims, seq_len, batch_seqs=bs, recompute=rc, dtype=dtype, name=name, training=training)
            except ValueError as e:
                out.refusal = str(e)
                continue
            out.valid += 1
            if out.smallest is None or p.peak < out.smallest.peak:
                out.smallest = p
            if p.fits:
                out.fitting.append(p)
    out.fitting.sort(key=lambda p: -p.tokens_per_s)
    best = pick(out.fitting)
    if best is not None:
        out.fitting.remove(best)
        out.fitting.insert(0, best)
    return out


def pick(plans: list[Plan]) -> Plan | None:
    """The fastest of ``plans`` (sorted fastest first); within 2 % of it, the smaller peak."""
    best = None
    for p in plans:
        if best is None or p.tokens_per_s > best.tokens_per_s * 1.02 or (
                p.tokens_per_s > best.tokens_per_s / 1.02 and p.peak < best.peak):
            best = p
    return best


def runner_ups(ranked: Ranked, n: int) -> list[Plan]:
    """The next ``n`` meshes after the best one, each with its own pick of recompute, fastest first."""
    by_mesh: dict[tuple, list[Plan]] = {}
    for p in ranked.fitting:
        by_mesh.setdefault(tuple(p.dims.values()), []).append(p)
    first = tuple(ranked.fitting[0].dims.values()) if ranked.fitting else None
    picks = [pick(ps) for key, ps in by_mesh.items() if key != first]
    return sorted(picks, key=lambda p: -p.tokens_per_s)[:n]


def search(c: DeepseekV4ModelConfig, gpus: int, seq_len: int, *, rows_target: int = 16384, name: str = "",
           **flags) -> Plan | None:
    """The best plan of :func:`rank_plans` (same keyword flags), ``None`` when nothing fits; ``ValueError`` naming
    the flags when no mesh of ``gpus`` takes them at all."""
    ranked = rank_plans(c, gpus, seq_len, rows_target=rows_target, name=name, **flags)
    check_valid(ranked, gpus, seq_len, flags)
    return ranked.fitting[0] if ranked.fitting else None


def check_valid(ranked: Ranked, gpus: int, seq_len: int, flags: dict) -> None:
    """``ValueError`` when no plan was valid: the flags that no mesh of ``gpus`` takes, and the last refusal."""
    if ranked.valid:
        return
    given = [f"--{k.replace('_', '-')} {v}" for k, v in flags.items()
             if k in ("batch_seqs", "recompute") and v is not None]
    given += [f"--{k.replace('_', '-')} {v}" for k, v in (flags.get("mesh") or {}).items()]
    raise ValueError(f"no mesh of {gpus} GPUs at --seq-len {seq_len} takes {' '.join(given) or 'these sizes'}"
                     f" (sizes are searched over powers of two; {ranked.refusal or 'no candidate'}): change or "
                     "drop the fixed flags")


@dataclass
class Suggestion:
    """One way to fit: what changes (``what``), and the plan that fits with it."""

    what: str
    plan: Plan


def nearest_fits(c: DeepseekV4ModelConfig, gpus: int, seq_len: int, *, dtype: str = "bfloat16",
                 training: Training | None = None, name: str = "", given: Plan | None = None,
                 max_gpus: int = 4096) -> list[Suggestion]:
    """What fits when ``gpus`` at ``seq_len`` does not, each found by searching (mesh and recompute free, one
    sequence per replica or ``16384 / seq_len``): ``given``'s mesh with more recompute, these GPUs with another
    mesh and recompute; else the fewest more GPUs (doubling, up to ``max_gpus``) and the longest shorter sequence
    (halving, down to 1024 tokens)."""
    kw = {"dtype": dtype, "training": training, "name": name}
    out = []
    if given is not None:
        dims = ParallelDims(**{k: given.dims[k] for k in MESH_FLAGS}, world=given.gpus)
        for rc in RECOMPUTE_CHOICES[RECOMPUTE_CHOICES.index(given.recompute) + 1:]:
            p = plan(c, dims, seq_len, batch_seqs=given.batch_seqs, recompute=rc, **kw)
            if p.fits:
                out.append(Suggestion(f"more recompute: {rc} (this mesh)", p))
                break
    p = _try(c, gpus, seq_len, kw)
    if p is not None:
        if not any(s.plan.dims == p.dims and s.plan.recompute == p.recompute for s in out):
            out.append(Suggestion("another mesh or recompute on these GPUs", p))
        return out
    if training is None or training.full:
        p = _try(c, gpus, seq_len, kw | {"training": training_spec(lora_rank=16)})
        if p is not None:
            out.append(Suggestion("a LoRA fine-tune (--lora-rank 16, the base frozen)", p))
    g = gpus * 2
    while g <= max_gpus:
        p = _try(c, g, seq_len, kw)
        if p is not None:
            out.append(Suggestion("more GPUs", p))
            break
        g *= 2
    L = seq_len // 2
    while L >= 1024:
        p = _try(c, gpus, L, kw)
        if p is not None:
            out.append(Suggestion("shorter sequences", p))
            break
        L //= 2
    return out


def _try(c: DeepseekV4ModelConfig, gpus: int, seq_len: int, kw: dict) -> Plan | None:
    try:
        return search(c, gpus, seq_len, **kw)
    except ValueError:
        return None


def docs_table(configs: tuple[tuple[str, str], ...] = (("V4-Flash", "benchmarks/configs/v4_flash.json"),
                                                       ("V4-Pro", "benchmarks/configs/v4_pro.json")),
               seq_lens: tuple[int, ...] = (4096, 65536, 1048576),
               gpus: tuple[int, ...] = (8, 16, 32, 64, 128, 256)) -> str:
    """Markdown: each model x sequence length x GPU count, the mesh and recompute :func:`search` picks."""
    out = ["# Planner: V4-Flash and V4-Pro on H200s", "",
           "Generated by `python -m csattn.parallel.plan --table > docs/plan.md` (no GPU). Each cell: the mesh "
           "(R = dp_replicate, S = dp_shard, C = cp, E = ep) and recompute `csattn plan` picks among those that fit "
           "(the fastest; within 2 % the smaller memory), its predicted per-rank peak in GiB and estimated step time; "
           f"each data replica reads max(1, 16384 / seq_len) sequences. Fit: peak <= {LIMIT_BYTES / GiB:.1f} GiB "
           f"({100 - HEADROOM * 100:.0f} % of the H200's {H200_BYTES / GiB:.1f} GiB, the rest left to the "
           "allocator). Memory: fp32 master weights, gradients and AdamW state sharded by FSDP2, bf16 "
           "compute copies of the root and two units in flight, kept activations from the measured bytes per token "
           "per layer (`KEPT_KIB`). Time: `model_flops` at the proxy's measured one-GPU MFU (`MFU_BY_ROWS`, "
           f"{_mfu_range()}) x the recompute's measured slow-down (`RECOMPUTE_SLOWDOWN`; all three in "
           "`csattn/parallel/plan/measured.py`, written from `benchmarks/results/h200/`), FSDP collectives "
           "overlapped except the first "
           "/ last unit and the root, EP all-to-all not overlapped (NVLink 900 GB/s in a node of 8, InfiniBand "
           "50 GB/s per GPU across nodes). Estimates, not measurements.", ""]
    for label, path in configs:
        c = load_config(path)
        pc = count_params(c)
        out += [f"## {label} ({pc.total / 1e9:.0f} B parameters, {pc.experts / 1e9:.0f} B in routed experts)", ""]
        out += _table(c, label, seq_lens, gpus, None)
    lora = training_spec(lora_rank=16)
    out += ["## V4-Flash, LoRA fine-tune", "",
            "`--lora-rank 16`: every group frozen, the routed experts held in FP8 (128x128 block scales) and "
            f"multiplied in FP8 (at {FP8_GEMM_SPEEDUP['fp8']:.2f}x the bf16 rate, measured on the frozen experts), "
            "the rest in bf16 (`csattn train "
            "--base-precision fp8`'s default), LoRA rank 16 on attention, indexer, shared and routed experts (2.7 B "
            "parameters).", ""]
    out += _table(load_config(configs[0][1]), configs[0][0], seq_lens, gpus[:3], lora)
    return "\n".join(out)


def _mfu_range() -> str:
    lo, hi = (f"{v * 100:.0f}" for v in (min(MFU_BY_ROWS.values()), max(MFU_BY_ROWS.values())))
    return f"{lo} %" if lo == hi else f"{lo}-{hi} %"


def _table(c: DeepseekV4ModelConfig, label: str, seq_lens: tuple[int, ...], gpus: tuple[int, ...],
           training: Training | None) -> list[str]:
    """One Markdown table: a row per sequence length, a cell per GPU count, each :func:`search`'s pick."""
    out = ["| tokens / seq | " + " | ".join(f"{g} GPUs" for g in gpus) + " |",
           "| ---: | " + " | ".join("---" for _ in gpus) + " |"]
    for L in seq_lens:
        cells = []
        for g in gpus:
            p = search(c, g, L, name=label, training=training)
            if p is None:
                cells.append("does not fit")
            else:
                d = p.dims
                cells.append(f"R{d['dp_replicate']} S{d['dp_shard']} C{d['cp']} E{d['ep']}, {p.recompute}: "
                             f"{p.peak / GiB:.0f} GiB, {p.step_s:.2f} s ({p.batch_seqs} seq)")
        label_len = f"{L // 1024}k" if L < 1048576 else f"{L // 1048576}M"
        out.append(f"| {label_len} | " + " | ".join(cells) + " |")
    return out + [""]
