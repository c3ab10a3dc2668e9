"""Fine-tuning DeepSeek-V4-Flash on one GPU, measured: ``python -m benchmarks.finetune --ckpt DIR --json OUT``.

On a real-geometry slice of V4-Flash (``benchmarks/configs/v4_flash_slice.json``: its first four layers, W / W /
CSA / HCA with three hash-routed MoEs, full widths, 256 experts top-6) loaded from a synthetic checkpoint in the
release's format (FP8 dense linears, MXFP4 experts; written once into ``--ckpt``: part ``write``, run before any
part that reads it), the parts (``--parts``; those not run are kept from an existing ``--json``):

- ``steps``: one training step (forward, backward, AdamW) at 16k and 64k tokens of packed documents per mode:
  (a) frozen FP8 experts multiplied in FP8 + LoRA rank 16 on attention, indexer, shared and routed experts;
  (b) the same, weight-only (``w8a16``); (c) frozen bf16 experts + the same LoRA; (d) everything trained in bf16.
  Each: tokens/s, MFU over the FLOPs run (:func:`csattn.models.deepseek_v4.flops.finetune_flops`: no
  weight-gradient GEMM for frozen weights, LoRA's GEMMs counted as the
  model runs them, the FP8 part apart), the step's peak (``torch.cuda.max_memory_allocated``, weights
  included), the weights' bytes by storage dtype, and the planner's predicted peak beside it (target: within 10 %).
  A case that runs out of memory is recorded as not fitting.
- ``moe``: the frozen-expert MoE alone (forward + input gradient; 256 experts top-6, 16k tokens, D 4096, I 2048):
  ``benchmarks.run --op moe_frozen`` with the FP8, weight-only and bf16 grouped paths (target FP8 >= 1.3x bf16),
  and the routed experts' bytes FP8 against bf16 (target <= 0.52x). Each path's median over ~0.5 s of calls (~25 at
  16k): over 60 ms (3 calls) two runs of one commit had differed by 3 %.
- ``logits``: the relative difference of the logits with FP8 compute against the weight-only mode, same weights
  (after loading), same batch.
- ``ranks``: the slice through ``csattn train`` on 2 gloo ranks sharing the GPU with ep 2 (torchrun), each rank's
  peak beside the planner's per-rank peak.

Modes (c) and (d) hold the experts the FP8 load converted exactly from MXFP4, dequantized to bf16 on the GPU: the
values ``load_pretrained(base_precision="bf16")`` gives (e4m3 codes times power-of-two scales are exact in bf16),
without reading and converting the checkpoint again. The JSON is rewritten after every record.

    python -m benchmarks.finetune --ckpt /tmp/v4slice --json finetune.json [--parts steps,moe,logits,ranks]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .run import run_meta

SLICE = os.path.join(os.path.dirname(__file__), "configs", "v4_flash_slice.json")
PARTS = ("write", "steps", "logits", "moe", "ranks")
LORA_TARGETS = ("attention", "indexer", "shared_experts", "experts")
TOLERANCE = 0.10  # the planner's target: within 10 % of every measured peak


@dataclass(frozen=True)
class Mode:
    """One way to fine-tune: how the routed experts are held and multiplied, and whether LoRA adapts them."""

    name: str
    what: str
    base: str  # "fp8" | "w8a16" | "bf16": the frozen experts' storage and compute
    lora: bool
    # "sgd" for (d): AdamW's two states of the slice's 26.6 B parameters (~99 GiB in bf16) beside its weights and
    # gradients do not fit one H200; plain SGD keeps no state and its step is a shorter pass over the weights than
    # AdamW's, so (d)'s tokens/s is an upper bound of AdamW's and (a) / (d) a lower bound of the speedup
    optimizer: str = "adamw"

    def training(self, rank: int) -> Any:
        """The planner's :class:`Training` of this mode."""
        from csattn.parallel.plan import training_spec

        if not self.lora:
            return training_spec(base_precision=self.base)
        return training_spec(lora_rank=rank, lora_targets=",".join(LORA_TARGETS), base_precision=self.base)


MODES = {
    "a": Mode("a", "frozen FP8 experts, FP8 compute, LoRA", "fp8", True),
    "b": Mode("b", "frozen FP8 experts, weight-only (w8a16), LoRA", "w8a16", True),
    "c": Mode("c", "frozen bf16 experts, LoRA", "bf16", True),
    "d": Mode("d", "everything trained, bf16 (SGD: AdamW's states do not fit one GPU)", "bf16", False, "sgd"),
}


def write_checkpoint(config_path: str, out: str, device: str, seed: int = 0, draw: str = "model") -> dict:
    """The release-format checkpoint of the slice in ``out`` (kept if its index and config are there already),
    quantized on ``device``; ``draw``: ``"model"``, the weights drawn on the CPU from the model's own generators
    (about 45 s a full-width layer), or ``"device"``, drawn on ``device`` at the same scales (seconds a layer on a
    GPU; other values)."""
    from csattn.models.deepseek_v4 import DeepseekV4ModelConfig
    from csattn.models.deepseek_v4.release import write_release_checkpoint

    done = all(os.path.exists(os.path.join(out, f)) for f in ("config.json", "model.safetensors.index.json"))
    rec: dict[str, Any] = {"path": out, "reused": done}
    if not done:
        with open(config_path) as f:
            config = DeepseekV4ModelConfig.from_hf(json.load(f))
        t0 = time.perf_counter()
        write_release_checkpoint(config, out, seed=seed, device=device, draw=draw)
        rec.update(draw=draw, write_s=round(time.perf_counter() - t0, 1))
    rec["gib_on_disk"] = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)) / 2**30
    return rec


def load_base(ckpt: str, device: str = "cpu") -> tuple[nn.Module, float]:
    """The slice with FP8-held frozen experts (MXFP4 converted exactly, on ``device``), bf16 elsewhere, on the CPU;
    load seconds."""
    from csattn.models.deepseek_v4.checkpoint import load_pretrained

    t0 = time.perf_counter()
    model = load_pretrained(ckpt, dtype=torch.bfloat16, base_precision="fp8", convert_device=device)
    return model, time.perf_counter() - t0


def set_fp8_compute(model: nn.Module, compute: str) -> None:
    """Every FP8-held module's mode: ``"fp8"`` (FP8 tensor cores) or ``"w8a16"`` (weight-only)."""
    for m in model.modules():
        if hasattr(m, "frozen_storage") and hasattr(m, "compute"):
            m.compute = compute


@torch.no_grad()
def dequantize_experts(model: nn.Module) -> None:
    """Replace every FP8-held experts module by bf16 :class:`Experts` of the same values, on its device."""
    from csattn.models.deepseek_v4.moe import Experts
    from csattn.models.deepseek_v4.quant import Fp8Experts

    for name, m in list(model.named_modules()):
        if not isinstance(m, Fp8Experts):
            continue
        gate_up, down = m.dequantized()
        with torch.device("meta"):
            new = Experts(m.num_experts, gate_up.shape[2], down.shape[2], m.limit, m.backend, local=m.local)
        new.gate_up_proj, new.down_proj = nn.Parameter(gate_up), nn.Parameter(down)
        new.init_seed = m.init_seed
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)


def copy_to(base: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``base`` whose parameters and buffers are on ``device``, each tensor copied once straight there
    (no second host copy of the model; FP8 codes keep their dtype)."""
    memo: dict[int, Any] = {}
    for m in base.modules():
        for store in (m._parameters, m._buffers):
            for t in store.values():
                if t is None or id(t) in memo:
                    continue
                moved = t.detach().to(device, copy=True)
                memo[id(t)] = nn.Parameter(moved, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                    else moved
    return copy.deepcopy(base, memo).to(device)  # anything held outside the parameters and buffers too


def prepare(base: nn.Module, mode: Mode, device: torch.device, rank: int, seed: int = 0) -> nn.Module:
    """A copy of ``base`` on ``device`` set up for ``mode``: the experts' compute or bf16 copy, what trains, LoRA."""
    model = copy_to(base, device)
    if mode.base == "bf16":
        dequantize_experts(model)
    else:
        set_fp8_compute(model, mode.base)
    if not mode.lora:
        for p in model.parameters():
            p.requires_grad_(p.is_floating_point() and p.dtype.itemsize > 1)
        return model
    from csattn.finetune import LoraSpec, add_lora, apply_freezing, init_lora, resolve_choice

    targets = ",".join(LORA_TARGETS)
    apply_freezing(model, resolve_choice(None, None, targets, rank))
    add_lora(model, LoraSpec(rank, float(rank), 0.0, LORA_TARGETS))
    init_lora(model, seed)
    return model


def weight_gib(model: nn.Module) -> dict[str, Any]:
    """Bytes of parameters and buffers (GiB) by storage dtype, their sum, the routed experts' and what trains."""
    by: dict[str, float] = {}
    experts = 0.0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        size = t.numel() * t.element_size() / 2**30
        by[str(t.dtype).removeprefix("torch.")] = by.get(str(t.dtype).removeprefix("torch."), 0.0) + size
        if ".mlp.experts." in name and "lora_" not in name:
            experts += size
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"by_dtype": by, "total": sum(by.values()), "experts": experts, "trained_params": trained}


def planned_gib(config: Any, mode: Mode, tokens: int, rank: int, world: int = 1, ep: int = 1) -> dict[str, Any]:
    """The planner's per-rank peak for ``mode`` at ``tokens`` per rank (no recompute, bf16)."""
    from csattn.parallel.mesh import ParallelDims
    from csattn.parallel.plan import plan

    dims = ParallelDims(world=world, **({"dp_shard": world, "ep": ep} if world > 1 else {}))
    p = plan(config, dims, tokens, recompute="none", training=mode.training(rank))
    stateless = p.memory.optimizer if mode.optimizer == "sgd" else 0  # the planner counts AdamW's states
    return {"planned_gib": round((p.peak - stateless) / 2**30, 2), "planned_fits": bool(p.fits)}


def lora_counts(model: nn.Module) -> dict[str, float]:
    """What the model's LoRA runs per token and rank, all its pairs factored: ``io``, a linear's ``in + out``; the
    grouped ``o_a_proj``'s ``A`` on every group's input; the shared expert's gate and up as one pair of rank 2r with a
    block-diagonal ``B``; the routed experts' two pairs for each of the ``k`` experts a token runs."""
    from csattn.finetune.lora import LoraExperts, lora_modules
    from csattn.layers.modules import GroupedLinear

    k = model.config.num_experts_per_tok
    io = 0.0
    for name, m in lora_modules(model):
        if isinstance(m, LoraExperts):
            d, i = m.lora_A_gate_up.shape[-1], m.lora_A_down.shape[-1]
            io += k * ((d + 2 * i) + (i + d))
            continue
        out, inp = m.lora_B.shape[0], m.lora_A.shape[-1]
        if isinstance(m, GroupedLinear):
            inp *= m.groups
        elif name.endswith(("shared_experts.gate_proj", "shared_experts.up_proj")):
            out *= 2
        io += inp + out
    return {"io": io}


def step_flops(config: Any, cu: list[int], mode: Mode, rank: int, lora: dict[str, float]) -> dict[str, float]:
    """The FLOPs one step of ``mode`` runs on documents ``cu`` (forward, backward, the FP8 part): the planner's
    per-group multiply-adds for what is frozen, the model's own LoRA counts (``lora_counts``)."""
    from csattn.models.deepseek_v4.flops import finetune_flops
    from csattn.parallel.plan import flop_counts

    # the load holds the routed experts in FP8 only (no --fp8-linears): as the planner's Training of the mode
    counts = flop_counts(config, mode.training(rank), fp8_held=mode.base == "fp8")
    return finetune_flops(config, cu, **{**counts, "lora_io": lora["io"]})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(model: nn.Module, tokens: int, device: torch.device, steps: int,
               optimizer: str = "adamw") -> dict[str, Any]:
    """``steps`` timed training steps (``optimizer`` "adamw" or "sgd") after one warm-up on the proxy's packed
    documents of ``tokens``: median ms, losses, the peak allocated (weights included) and the documents."""
    from csattn.report.model import proxy_batch, proxy_lengths

    lengths = proxy_lengths(tokens)
    ids, packed, labels = proxy_batch(lengths, model.config.vocab_size, device)
    params = [p for p in model.parameters() if p.requires_grad]
    fused = device.type == "cuda"
    opt = torch.optim.SGD(params, lr=1e-5, fused=fused) if optimizer == "sgd" else \
        torch.optim.AdamW(params, lr=1e-5, fused=fused)
    times, losses = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(steps + 1):
        _sync(device)
        t0 = time.perf_counter()
        loss = model(ids, packed=packed, labels=labels, return_logits=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        losses.append(float(loss.detach()))
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del opt
    return {"docs": lengths, "ms": sorted(times)[len(times) // 2], "steps_ms": times, "losses": losses,
            "peak_gib": peak}


def measure_mode(base: nn.Module, mode: Mode, tokens: list[int], args: argparse.Namespace,
                 record: Any) -> None:
    """One mode, built once, at each length of ``tokens``: time it, compare with the planner; ``record(rec)`` gets
    each length's record as soon as it is measured. Out of memory is a record, not a crash (and ends the mode: a
    longer stream does not fit either)."""
    device = torch.device(args.device)
    model, built = None, None
    try:
        model = prepare(base, mode, device, args.lora_rank)
    except Exception as e:  # noqa: BLE001 - the JSON says what broke; the other modes go on
        built = "does not fit (out of memory)" if isinstance(e, torch.cuda.OutOfMemoryError) else \
            f"{type(e).__name__}: {str(e)[:300]}"
    try:
        for n in tokens:
            rec: dict[str, Any] = {"mode": mode.name, "what": mode.what, "tokens": n,
                                   "lora_rank": args.lora_rank if mode.lora else 0,
                                   **planned_gib(base.config, mode, n, args.lora_rank)}
            if built:
                rec["error"] = built
            else:
                rec.update(_one_case(model, mode, n, args, device))
            record(rec)
            if rec.get("error"):
                break
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _one_case(model: nn.Module, mode: Mode, tokens: int, args: argparse.Namespace,
              device: torch.device) -> dict[str, Any]:
    from csattn.models.deepseek_v4.flops import peak_flops

    rec: dict[str, Any] = {}
    try:
        rec["weights_gib"], rec["lora_counts"] = weight_gib(model), lora_counts(model)
        rec.update(time_steps(model, tokens, device, args.steps, mode.optimizer), optimizer=mode.optimizer)
    except torch.cuda.OutOfMemoryError:
        rec["error"] = "does not fit (out of memory)"
    except Exception as e:  # keep the other cases going; the JSON says what broke
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rec.get("ms"):
        cu = [0, *torch.tensor(rec["docs"]).cumsum(0).tolist()]
        fl = step_flops(model.config, cu, mode, args.lora_rank, rec["lora_counts"])
        run = fl["fwd"] + fl["bwd"]
        rec.update(flops=fl, tokens_per_s=tokens / rec["ms"] * 1e3, tflops=run / rec["ms"] / 1e9)
        peak = peak_flops(device, args.peak_tflops)
        rec["mfu"] = rec["tflops"] * 1e12 / peak if peak else None
    return rec


def run_steps(base: nn.Module, args: argparse.Namespace, out: dict) -> None:
    """Every case of ``args.cases`` (mode -> lengths), each record into the JSON as soon as it is measured."""
    for name, tokens in args.cases:
        mode = MODES[name]
        print(f"[steps] ({name}) {mode.what}, {tokens} tokens", flush=True)

        def record(rec: dict[str, Any], name: str = name) -> None:
            if rec.get("peak_gib"):
                rec["planned_over_peak"] = rec["planned_gib"] / rec["peak_gib"]
                rec["planner_within_10pct"] = abs(rec["planned_over_peak"] - 1) <= TOLERANCE
            out["results"].append(rec)
            out["expert_bytes"] = expert_bytes(out["results"])
            _dump(args.json, out)
            print(f"[steps] ({name}) {rec['tokens']}: " + (rec.get("error") or f"{rec['ms']:.1f} ms, "
                  f"{rec['tokens_per_s']:.0f} tok/s, peak {rec.get('peak_gib')} GiB, planned "
                  f"{rec['planned_gib']} GiB"), flush=True)

        measure_mode(base, mode, tokens, args, record)


@torch.no_grad()
def logits_diff(base: nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    """``||l_fp8 - l_w8a16|| / ||l_w8a16||`` of the loaded slice's logits, same weights and batch (and the largest
    element difference over the largest logit)."""
    from csattn.report.model import proxy_batch, proxy_lengths

    device = torch.device(args.device)
    model = copy_to(base, device)
    lengths = proxy_lengths(args.logits_tokens)
    ids, packed, _ = proxy_batch(lengths, model.config.vocab_size, device)
    out = {}
    for compute in ("fp8", "w8a16"):
        set_fp8_compute(model, compute)
        out[compute] = model(ids, packed=packed).logits.float()
    del model
    diff = out["fp8"] - out["w8a16"]
    return {"tokens": sum(lengths), "rel_l2": float(diff.norm() / out["w8a16"].norm()),
            "max_abs_over_max": float(diff.abs().max() / out["w8a16"].abs().max())}


def moe_micro(args: argparse.Namespace, out: dict | None = None) -> dict[str, Any]:
    """The frozen-expert MoE alone through ``benchmarks.run --op moe_frozen``, the speed-ups over bf16 and the
    routed experts' bytes FP8 over bf16. One provider at a time, each record into ``out["moe"]`` (and the JSON) as
    soon as it is measured."""
    from . import run as bench

    recs: list[dict] = []
    for provider in ("fp8", "w8a16", "bf16"):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "moe.json")
            bench.main(["--op", "moe_frozen", "--providers", provider, "--mode", "fwdbwd", "--shape",
                        f"tokens={args.moe_tokens}", "--device", args.device, "--warmup-ms", "100", "--rep-ms", "500",
                        "--json", path])
            with open(path) as f:
                recs += json.load(f)["results"]
        if out is not None:
            out["moe"] = _moe_summary(recs)
            _dump(args.json, out)
    return _moe_summary(recs)


def _moe_summary(recs: list[dict]) -> dict[str, Any]:
    from csattn.parallel.plan import FP8_BYTES

    by = {r["provider"]: r for r in recs}
    bf16 = by.get("bf16", {}).get("ms")
    speed = {p: bf16 / r["ms"] for p, r in by.items() if r.get("ms") and bf16 and p != "bf16"}
    e, d, i = 256, 4096, 2048  # V4-Flash's routed experts of one layer
    fp8_bytes = e * 3 * d * i * FP8_BYTES  # e4m3 codes + one fp32 scale per 128x128 block
    return {"records": recs, "speedup_over_bf16": speed, "target_fp8_speedup": 1.3,
            "expert_bytes_fp8_over_bf16": fp8_bytes / (e * 3 * d * i * 2), "target_bytes": 0.52}


def _dump(path: str, out: dict) -> None:
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def rank_args(ckpt: str, tokens: int, steps: int, rank: int, metrics: str, base: str | None,
              device: str = "cuda") -> list[str]:
    """``csattn train``'s arguments for LoRA on dp_shard 2 x ep 2 gloo ranks; ``base``: ``--base-precision``
    (None: the trainer's default, bf16 experts)."""
    return ["--init-from", ckpt, "--dtype", "bfloat16" if device == "cuda" else "float32", "--device", device,
            "--dist-backend", "gloo",
            "--dist-timeout", "300", "--dp-shard", "2", "--ep", "2", "--seq-len", str(tokens), "--steps", str(steps),
            "--lr", "1e-4", "--min-lr", "1e-5", "--warmup-steps", "1", "--doc-min-len", "256", "--doc-max-len", "8192",
            "--lora-rank", str(rank), "--lora-alpha", str(rank), "--lora-targets", ",".join(LORA_TARGETS),
            *(["--base-precision", base] if base else []), "--export-hf", "never", "--no-progress",
            "--log-every", "1", "--metrics", metrics]


def run_ranks(config: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Mode (a) through ``csattn train`` on 2 gloo ranks sharing the GPU (ep 2): each rank's peak beside the
    planner's per-rank peak."""
    mode, tokens = MODES["a"], args.rank_tokens
    rec: dict[str, Any] = {"mode": mode.name, "ranks": 2, "mesh": "dp_shard 2 x ep 2 (gloo, one GPU)",
                           "tokens_per_rank": tokens, **planned_gib(config, mode, tokens, args.lora_rank, 2, 2)}
    base = mode.base
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "benchmarks.finetune", "--rank-peaks", tmp, "--",
               *rank_args(args.ckpt, tokens, args.rank_steps, args.lora_rank, metrics, base,
                         getattr(args, "device", "cuda"))]
        rec["command"] = " ".join(cmd[1:])
        try:
            rc = subprocess.run(cmd, timeout=args.rank_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        peaks = {}
        for r in range(2):
            path = os.path.join(tmp, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    peaks[r] = json.load(f)["peak_gib"]
        steps = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    rec.update(rc=rc, peak_gib_per_rank=[peaks.get(r) for r in range(2)],
               losses=[s.get("loss") for s in steps], tokens_per_s=steps[-1].get("tokens_per_s") if steps else None)
    if rc != 0:
        rec["error"] = f"rc {rc}"
    if peaks:
        ratios = [rec["planned_gib"] / p for p in peaks.values() if p]
        rec["planned_over_peak"] = ratios
        rec["planner_within_10pct"] = all(abs(x - 1) <= TOLERANCE for x in ratios)
    return rec


def rank_peaks(out_dir: str, train_args: list[str]) -> int:
    """Under torchrun: ``csattn train`` in this process, then this rank's peak into ``out_dir/rank{R}.json``."""
    from csattn.cli import main as csattn_main

    rc = csattn_main(["train", *train_args])
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    with open(os.path.join(out_dir, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump({"peak_gib": peak, "rc": rc}, f)
    return int(rc or 0)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", help="the slice's release-format checkpoint (written here if absent)")
    ap.add_argument("--json", help="the output file")
    ap.add_argument("--config", default=SLICE, help="the geometry (default: the V4-Flash slice)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--modes", default="a,b,c,d", help="comma list of " + ", ".join(MODES))
    ap.add_argument("--tokens", default="16384,65536", help="tokens per step, comma list")
    ap.add_argument("--cases", default=None, help="lengths per mode instead of --modes x --tokens, e.g. "
                    "'a:16384,65536;b:16384;c:16384,65536;d:16384' (in this order)")
    ap.add_argument("--draw", choices=("model", "device"), default="model", help="part write: the weights drawn "
                    "on the CPU from the model's generators, or on --device at the same scales (fast)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per case, after one warm-up")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--logits-tokens", type=int, default=4096)
    ap.add_argument("--moe-tokens", type=int, default=16384)
    ap.add_argument("--rank-tokens", type=int, default=16384, help="the 2-rank run's tokens per rank")
    ap.add_argument("--rank-steps", type=int, default=3)
    ap.add_argument("--rank-timeout", type=int, default=300)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="MFU denominator (default: the H200's measured)")
    ap.add_argument("--commit", default=os.environ.get("CSATTN_COMMIT"), help="recorded commit")
    ap.add_argument("--rank-peaks", default=None, help=argparse.SUPPRESS)  # internal: one rank of the ranks part
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--rank-peaks" in argv and "--" in argv:
        cut = argv.index("--")
        return rank_peaks(_parser().parse_args(argv[:cut]).rank_peaks, argv[cut + 1:])
    ap = _parser()
    args = ap.parse_args(argv)
    if not args.ckpt or not args.json:
        ap.error("--ckpt and --json are required")
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS] + [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        ap.error(f"--parts / --modes: unknown {bad}; parts are {PARTS}, modes {tuple(MODES)}")
    args.modes, args.tokens = args.modes.split(","), [int(t) for t in args.tokens.split(",")]
    args.cases = _cases(args.cases) if args.cases else [(m, args.tokens) for m in args.modes]
    if any(m not in MODES for m, _ in args.cases):
        ap.error(f"--cases: modes are {tuple(MODES)}")
    device = torch.device(args.device)
    out: dict[str, Any] = {"meta": {**run_meta(device, args.commit), "config": os.path.relpath(args.config),
                                    "modes": {k: m.what for k, m in MODES.items()}, "lora_rank": args.lora_rank,
                                    "lora_targets": list(LORA_TARGETS)}, "results": []}
    out.update(_kept_parts(args.json, parts))
    if set(parts) & {"write", "steps", "logits", "ranks"}:  # the MoE benchmark alone needs no checkpoint
        rec = write_checkpoint(args.config, args.ckpt, args.device, draw=args.draw)
        # reused: how an earlier part of the session wrote it stays on record
        out["checkpoint"] = {**out.get("checkpoint", {}), **rec} if rec["reused"] else rec
        _dump(args.json, out)
        print(f"[checkpoint] {out['checkpoint']}", flush=True)
    if "steps" in parts or "logits" in parts:
        base, load_s = load_base(args.ckpt, args.device)
        out["checkpoint"]["load_fp8_s"] = round(load_s, 1)
        _dump(args.json, out)
        if "steps" in parts:
            run_steps(base, args, out)
        if "logits" in parts:
            out["logits"] = _guarded(logits_diff, base, args)
            print(f"[logits] {out['logits']}", flush=True)
            _dump(args.json, out)
        del base
        gc.collect()
    if "moe" in parts:
        out["moe"] = _guarded(moe_micro, args, out)
        _dump(args.json, out)
    if "ranks" in parts:
        from csattn.parallel.plan import load_config

        out["ranks"] = _guarded(run_ranks, load_config(args.config), args)
    _dump(args.json, out)
    return 0


def _cases(text: str) -> list[tuple[str, list[int]]]:
    """``"a:16384,65536;d:16384"`` -> ``[("a", [16384, 65536]), ("d", [16384])]``."""
    out = []
    for item in text.split(";"):
        mode, _, tokens = item.partition(":")
        out.append((mode.strip(), [int(t) for t in tokens.split(",") if t.strip()]))
    return out


def _kept_parts(path: str, parts: list[str]) -> dict[str, Any]:
    """The parts an earlier run wrote to ``path`` that this run does not measure (so parts run in separate
    processes, each with its own time limit, end in one file)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        prev = json.load(f)
    keys = {"steps": ("results", "expert_bytes"), "logits": ("logits",), "moe": ("moe",), "ranks": ("ranks",),
            "write": ("checkpoint",)}
    return {k: prev[k] for part, ks in keys.items() if part not in parts for k in ks if k in prev}


def expert_bytes(results: list[dict]) -> dict[str, Any] | None:
    """The routed experts' bytes held by mode (a) (FP8 codes and scales) over mode (c)'s (bf16), as measured."""
    held = {r["mode"]: r["weights_gib"]["experts"] for r in results if r.get("weights_gib")}
    if "a" not in held or "c" not in held:
        return None
    return {"fp8_gib": held["a"], "bf16_gib": held["c"], "ratio": held["a"] / held["c"], "target": 0.52}


def _guarded(fn, *args: Any) -> dict[str, Any]:
    try:
        return fn(*args)
    except Exception as e:  # one part failing leaves the others' numbers
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


if __name__ == "__main__":
    raise SystemExit(main())
