"""``csattn plan``: the flags, the per-rank table, the ``csattn train`` line to copy, the runner-ups and what would
fit when nothing does."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

from ...models.deepseek_v4.config import RECOMPUTE_CHOICES, DeepseekV4ModelConfig
from ..mesh import ParallelDims
from .counts import BASE_PRECISIONS, DEFAULT_LORA_TARGETS, GROUPS, Training, training_spec
from .load import load_config
from .memory import plan
from .meshes import MESH_FLAGS, Suggestion, check_valid, docs_table, nearest_fits, rank_plans, runner_ups
from .records import H200_BYTES, HEADROOM, GiB, Plan
from .timing import GPUS_PER_NODE

__all__ = ["add_plan_args", "format_plan", "main", "run_plan", "train_command"]

RUNNER_UPS = 3


def _mesh_str(d: dict[str, int]) -> str:
    return f"R{d['dp_replicate']} S{d['dp_shard']} C{d['cp']} E{d['ep']}"


def train_command(p: Plan) -> str:
    """The ``csattn train`` line that runs ``p`` (``torchrun`` over nodes of 8 beyond 8 GPUs)."""
    d = p.dims
    model = _model_flag(p.config_path or "CONFIG.json")
    if p.training.get("fp8") and not model.startswith("--init-from"):
        # an FP8-held base is read from the release checkpoint this config.json belongs to (no initializer)
        model = "--init-from CHECKPOINT_DIR"
    flags = [model, f"--dtype {p.dtype}", f"--seq-len {p.seq_len}",
             f"--batch-seqs {p.batch_seqs}"]
    if p.gpus > 1:
        if d["dp_replicate"] > 1:
            flags.append(f"--dp-replicate {d['dp_replicate']}")
        flags += [f"--dp-shard {d['dp_shard']}", f"--cp {d['cp']}", f"--ep {d['ep']}"]
    flags.append(f"--recompute {p.recompute}")
    flags += _training_flags(p.training)
    if p.gpus == 1:
        return "csattn train " + " ".join(flags)
    nodes, per_node = _nodes(p.gpus)
    launch = (f"torchrun --nproc-per-node {p.gpus}" if nodes == 1 else
              f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-endpoint $HOST:29500")
    return f"{launch} -m csattn train " + " ".join(flags)


def _nodes(gpus: int) -> tuple[int, int]:
    """(nodes, GPUs per node): nodes of 8, or of the largest count up to 8 dividing ``gpus``."""
    per_node = max(k for k in range(1, GPUS_PER_NODE + 1) if gpus % k == 0)
    return gpus // per_node, per_node


def _model_flag(path: str) -> str:
    """``--init-from DIR`` when ``path`` is (the config.json of) a checkpoint directory, else ``--config-json``."""
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    if os.path.isdir(path) or os.path.basename(path) == "config.json":
        if any(f.endswith((".safetensors", ".safetensors.index.json")) for f in os.listdir(folder)):
            return f"--init-from {folder}"
    return f"--config-json {os.path.join(path, 'config.json') if os.path.isdir(path) else path}"


def _trains_everything(t: dict) -> bool:
    """Whether ``p.training`` is a full run (every group trained, no LoRA: no fine-tuning flags or lines)."""
    return not t or (t["lora_rank"] == 0 and len(t["train"]) == len(GROUPS))


def _training_flags(t: dict) -> list[str]:
    """The fine-tuning flags of ``p.training`` (none when everything trains)."""
    if _trains_everything(t):
        return []
    out = [f"--train {','.join(t['train'])}"] if t["train"] else []
    if t["lora_rank"]:
        out += [f"--lora-rank {t['lora_rank']}", f"--lora-targets {','.join(t['lora_targets'])}"]
    out.append(f"--base-precision {t['base_precision']}")
    return out + (["--fp8-linears"] if t.get("fp8_linears") else [])


def _gib(b: float) -> str:
    return f"{b / GiB:8.2f}"


def format_plan(p: Plan) -> str:
    """The per-rank table of one plan, its fit and the line that runs it (GiB throughout)."""
    d = p.dims
    n, per_node = _nodes(p.gpus)
    nodes = f" ({n} nodes of {per_node})" if n > 1 else ""
    lines = [f"plan: {p.config or 'model'}, {p.params_total / 1e9:.2f} B parameters, on {p.gpus} GPU(s){nodes}"]
    if p.sharded:
        lines += [f"  mesh: dp_replicate {d['dp_replicate']} x dp_shard {d['dp_shard']} x cp {d['cp']} = {p.gpus} "
                  f"ranks; routed experts over ep {d['ep']} x efsdp {d['efsdp']}",
                  "        (efsdp: the experts' FSDP mesh, what ep leaves of dp_shard x cp)"]
    per = p.batch_seqs // (d["dp_replicate"] * d["dp_shard"])
    lines.append(f"  batch: {p.batch_seqs} sequence(s) of {p.seq_len} tokens per step ({per} per data replica), "
                 f"{p.rows} rows per rank; recompute {p.recompute}; {p.dtype}; "
                 f"{'FSDP2, fp32 master weights' if p.sharded else 'one process, no FSDP'}")
    lines += _training_lines(p)
    lines.append("  per rank (GiB):")
    lines += [f"    {k:<18}{_gib(v)}" for k, v in p.memory.terms()]
    lines.append(f"  peak: {p.peak / GiB:.2f} GiB per rank, at {p.peak_at}: the figure that decides the fit (the "
                 "terms above never all peak at once)")
    lines.append(f"fit: {'yes' if p.fits else 'NO'}: peak {p.peak / GiB:.2f} GiB "
                 f"{'<=' if p.fits else '>'} {p.limit / GiB:.2f} GiB usable (H200 {H200_BYTES / GiB:.1f} GiB, "
                 f"{HEADROOM * 100:.0f} % left to the allocator)")
    t = p.time
    parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items() if v and k != "fsdp total")
    if t.get("fsdp total"):
        parts += f"; FSDP traffic {t['fsdp total'] * 1e3:.1f} ms, overlapped with compute but for the exposed part"
    lines.append(f"step time (estimated): {p.step_s * 1e3:.1f} ms ({parts}); {p.tokens_per_s / 1e3:.1f}k tokens/s, "
                 f"{p.tokens_per_s / p.gpus / 1e3:.2f}k tokens/s/GPU")
    lines.extend(f"  note: {n}" for n in p.notes)
    if p.fits:
        lines += ["run it:", "  " + train_command(p)]
        if "CHECKPOINT_DIR" in lines[-1]:
            lines.append("  (CHECKPOINT_DIR: the release checkpoint of this config, whose FP8 / MXFP4 weights "
                         f"--base-precision {p.training['base_precision']} holds as they are)")
    return "\n".join(lines)


def _training_lines(p: Plan) -> list[str]:
    t = p.training
    if _trains_everything(t):
        return []
    frozen = [g for g in GROUPS if g not in t["train"]]
    fp8 = t.get("fp8", [])
    held = (f"; held in FP8 ({t['base_precision']}): {', '.join(fp8)}, the rest bf16 / fp32" if fp8
            else "; held in bf16 / fp32")
    out = [f"  training: {p.params_trained / 1e9:.3f} B of {p.params_total / 1e9:.2f} B parameters trained",
           f"    in full: {', '.join(t['train']) or 'none'}; frozen: {', '.join(frozen)}{held}"]
    if t["lora_rank"]:
        out.append(f"    LoRA rank {t['lora_rank']} on {', '.join(t['lora_targets'])}: "
                   f"{p.params_lora / 1e6:.1f} M parameters")
    return out


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``csattn plan`` (each with help)."""
    p.add_argument("--config", metavar="FILE|DIR", help="the model's HF config.json, or a checkpoint directory "
                   "holding one (required unless --table)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs (world size), 8 per node (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=16384, help="tokens per packed sequence (default %(default)s)")
    p.add_argument("--batch-seqs", type=int, default=None, help="sequences per optimizer step, split over the data "
                   "replicas (default: one per replica; with --search, max(1, 16384 / seq-len) per replica)")
    p.add_argument("--dp-replicate", type=int, default=None, help="data-parallel replicas each holding the whole "
                   "sharded model (HSDP across nodes; default 1; with --search: searched unless given)")
    p.add_argument("--dp-shard", type=int, default=None, help="ranks FSDP2 shards over; -1 = what the other sizes "
                   "leave of --gpus (default -1; with --search: searched unless given)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel ranks splitting each sequence (default 1; "
                   "with --search: searched unless given)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel ranks the routed experts are split over, "
                   "taken from dp-shard x cp (default 1; with --search: searched unless given)")
    p.add_argument("--recompute", choices=RECOMPUTE_CHOICES, default=None, help="what the backward recomputes "
                   "instead of keeping (default none; with --search: searched unless given)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="compute dtype of the trained weights (default %(default)s)")
    f = p.add_argument_group("fine-tuning (default: every parameter trained)")
    f.add_argument("--lora-rank", type=int, default=0, metavar="R", help="LoRA pairs of rank R on the frozen "
                   "groups of --lora-targets; with R > 0 every group not in --train is frozen (default "
                   "%(default)s: no LoRA)")
    f.add_argument("--lora-targets", metavar="GROUPS", default=None, help="comma-separated groups LoRA adapts "
                   f"(default with --lora-rank: {','.join(DEFAULT_LORA_TARGETS)}); groups: {','.join(GROUPS)}")
    f.add_argument("--train", metavar="GROUPS", default=None, help="comma-separated groups trained in full, the "
                   "others frozen (default: all, or none with --lora-rank)")
    f.add_argument("--freeze", metavar="GROUPS", default=None, help="comma-separated groups frozen, the others "
                   "trained in full (instead of --train)")
    f.add_argument("--base-precision", choices=BASE_PRECISIONS, default=None, help="frozen routed experts (with "
                   "--fp8-linears the frozen dense linears too): fp8 = FP8 e4m3 with 128x128 block scales, multiplied "
                   "in FP8; w8a16 = held in FP8, dequantized to bf16 to multiply; bf16 (default fp8)")
    f.add_argument("--fp8-linears", action="store_true", help="with --base-precision fp8 / w8a16, hold the frozen "
                   "dense linears (attention, indexer, compressor, shared experts) that LoRA does not adapt in FP8 "
                   "too, as csattn train --fp8-linears does (default: the routed experts only)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (with --search: the best plan)")
    p.add_argument("--search", action="store_true", help="pick the fastest mesh and recompute that fit (the mesh "
                   "flags, --recompute and --batch-seqs, when given, are kept fixed) and show the runner-ups")
    p.add_argument("--table", action="store_true", help="print docs/plan.md (V4-Flash and V4-Pro searched over GPU "
                   "counts and sequence lengths); takes no other flag")


def _mesh_flags(args: argparse.Namespace) -> dict[str, int]:
    return {k: getattr(args, k) for k in MESH_FLAGS if getattr(args, k) is not None}


def run_plan(args: argparse.Namespace) -> int:
    """Run ``csattn plan``: 0 when the plan fits (or the plain plan was printed), 1 when a search finds nothing
    that fits; ``ValueError`` naming the flag for bad input."""
    if args.table:
        if args.config or args.search:
            raise ValueError("--table prints the fixed docs table and takes no --config / --search")
        print(docs_table())
        return 0
    if not args.config:
        raise ValueError("--config FILE is required (the model's HF config.json), or --table")
    c = load_config(args.config)
    name = os.path.basename(os.path.normpath(args.config)).removesuffix(".json")
    training = training_spec(lora_rank=args.lora_rank, lora_targets=args.lora_targets, train=args.train,
                             freeze=args.freeze, base_precision=args.base_precision,
                             fp8_linears=args.fp8_linears)
    if args.search:
        return _run_search(args, c, name, training)
    m = _mesh_flags(args)
    dims = ParallelDims(dp_replicate=m.get("dp_replicate", 1), dp_shard=m.get("dp_shard", -1), cp=m.get("cp", 1),
                        ep=m.get("ep", 1), world=args.gpus)
    p = plan(c, dims, args.seq_len, batch_seqs=args.batch_seqs, recompute=args.recompute or "none",
             dtype=args.dtype, name=name, training=training)
    p.config_path = args.config
    if args.json:
        print(json.dumps(asdict(p), indent=1))
        return 0
    print(format_plan(p))
    if not p.fits:
        _print_nearest(args, c, name, training, given=p)
    return 0


def _run_search(args: argparse.Namespace, c: DeepseekV4ModelConfig, name: str, training: Training) -> int:
    flags = {"batch_seqs": args.batch_seqs, "recompute": args.recompute, "mesh": _mesh_flags(args)}
    ranked = rank_plans(c, args.gpus, args.seq_len, dtype=args.dtype, training=training, name=name, **flags)
    check_valid(ranked, args.gpus, args.seq_len, flags)
    if not ranked.fitting:
        s = ranked.smallest
        print(f"does not fit: no mesh and recompute of {args.gpus} GPU(s) fits {args.seq_len} tokens per sequence "
              f"(smallest peak {s.peak / GiB:.2f} GiB per rank, {_mesh_str(s.dims)} recompute {s.recompute}; "
              f"usable {s.limit / GiB:.2f} GiB)")
        _print_nearest(args, c, name, training)
        return 1
    for p in ranked.fitting:
        p.config_path = args.config
    best = ranked.fitting[0]
    if args.json:
        print(json.dumps(asdict(best), indent=1))
        return 0
    print(format_plan(best))
    others = runner_ups(ranked, RUNNER_UPS)
    if others:
        print("next best meshes (R dp_replicate, S dp_shard, C cp, E ep):")
        for i, p in enumerate(others, start=2):
            print(f"  {i}. {_mesh_str(p.dims)}, recompute {p.recompute}: peak {p.peak / GiB:.2f} GiB, "
                  f"{p.tokens_per_s / 1e3:.1f}k tokens/s ({(p.tokens_per_s / best.tokens_per_s - 1) * 100:+.1f} %)")
    return 0


def _print_nearest(args: argparse.Namespace, c: DeepseekV4ModelConfig, name: str, training: Training,
                   given: Plan | None = None) -> None:
    found = nearest_fits(c, args.gpus, args.seq_len, dtype=args.dtype, training=training, name=name, given=given)
    if not found:
        print("nothing near fits: not with more recompute, up to 4096 GPUs, nor down to 1024 tokens per sequence")
        return
    print("nearest that fit:")
    for s in found:
        _print_suggestion(s, args.config)


def _print_suggestion(s: Suggestion, config: str) -> None:
    p = s.plan
    p.config_path = config
    print(f"  {s.what}: {p.gpus} GPU(s), {_mesh_str(p.dims)}, recompute {p.recompute}, seq_len {p.seq_len}: "
          f"peak {p.peak / GiB:.2f} GiB, {p.tokens_per_s / 1e3:.1f}k tokens/s")
    print(f"    {train_command(p)}")


def main(argv: list[str] | None = None) -> int:
    """``python -m csattn.parallel.plan``: as ``csattn plan``."""
    parser = argparse.ArgumentParser(prog="python -m csattn.parallel.plan",
                                     description="Memory and step-time planner for sharded training")
    add_plan_args(parser)
    try:
        return run_plan(parser.parse_args(argv))
    except ValueError as e:
        parser.error(str(e))
    return 2
