"""The planner's measured constants, ``csattn/parallel/plan/measured.py``, written from the results JSON.

``csattn`` may not import ``benchmarks``, so ``python -m benchmarks.results`` writes the constants the planner reads
as one generated module beside the page and the README's figures: re-measuring updates the planner.
``tests/parallel/test_plan_measured.py`` fails when the committed module is not what the JSON renders now.

- ``MFU_BY_ROWS``: the proxy's one-GPU MFU by tokens per step (recompute none), the ``mfu`` of each record of
  ``model.json`` and ``model_128k.json``;
- ``FP8_GEMM_SPEEDUP``: the frozen routed experts' grouped GEMMs (forward + input gradient), bf16's time over each
  FP8-held compute mode's (``finetune.json``'s ``moe`` records);
- ``TRANSIENT``: the backward's memory beyond what is kept, the same proxy records' ``peak_gib`` less their kept bytes
  (the planner's ``kept_bytes_per_token``), a line through the shortest and the longest: a fixed part less the
  attention core's workspace, and a part per token;
- ``KEPT_KIB``: what the proxy's forward keeps for the backward, KiB per token per layer by component
  (``model_kept.json``, ``python -m benchmarks.live_tensors --model``): each layer kind's modules averaged over its
  layers, the embedding and the head per model;
- ``RECOMPUTE_SLOWDOWN``: each recompute's step time over the step without recompute measured at the same commit
  (``model_recompute.json``).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from .data import Results, commit_of

__all__ = ["KEPT", "MEASURED", "MODEL_FILES", "RECOMPUTE", "kept_kib", "planner_constants", "recompute_slowdown",
           "render_measured", "write_measured"]

MEASURED = Path("csattn") / "parallel" / "plan" / "measured.py"  # in the repository
MODEL_FILES = ("model.json", "model_128k.json")
FINETUNE = "finetune.json"
KEPT = "model_kept.json"
RECOMPUTE = "model_recompute.json"
RECOMPUTE_MODES = ("none", "mhc", "moe", "block", "full")
_GiB = 2**30
WIDTH = 116  # the generated module's text width


class MissingMeasurement(ValueError):
    """The JSON folder lacks a measurement the planner's constants are derived from."""


def _proxy_rows(res: Results) -> list[dict[str, Any]]:
    """The proxy's default step (csattn, recompute none, 8 experts top-2, 4 layers) by tokens, shortest first."""
    rows = {}
    for name in MODEL_FILES:
        for r in res.records(name, provider="csattn", variant="", recompute="none", docs="ragged", experts=8,
                             topk_experts=2, layers=4):
            if r.get("ms") is not None and r.get("mfu") and r.get("peak_gib"):
                rows[r["shape"]["tokens"]] = {**r, "file": name}
    if len(rows) < 2:
        raise MissingMeasurement(f"the planner's MFU and transient memory need the proxy's step (recompute none) at "
                                 f"two lengths or more in {' / '.join(MODEL_FILES)}: measure them (python -m "
                                 "benchmarks.results --measure --stages model)")
    return [rows[t] for t in sorted(rows)]


def _fp8_speedup(res: Results) -> tuple[dict[str, float], dict[str, dict[str, Any]], str]:
    """bf16's time over each FP8-held mode's, the MoE's records by provider, and the commit they were measured at."""
    data = res.files.get(FINETUNE) or {}
    by = {r["provider"]: r for r in (data.get("moe") or {}).get("records", []) if r.get("ms")}
    if "bf16" not in by or not {"fp8", "w8a16"} <= set(by):
        raise MissingMeasurement(f"the planner's FP8 GEMM rate needs {FINETUNE}'s frozen-expert MoE (bf16, fp8, "
                                 "w8a16): measure it (python -m benchmarks.results --measure --stages finetune)")
    speedup = {p: round(by["bf16"]["ms"] / by[p]["ms"], 4) for p in ("fp8", "w8a16")}
    return speedup, by, commit_of(by["bf16"], data.get("meta"))


def _transient(rows: list[dict[str, Any]], kept_kib: dict[str, float]) -> tuple[dict[str, float], float]:
    """``TRANSIENT`` through the shortest and longest proxy steps (their kept bytes from ``kept_kib``), and the worst
    relative miss of the step peak at the lengths between."""
    from csattn.parallel.plan import kept_bytes_per_token
    from csattn.parallel.plan.counts import layer_kinds
    from csattn.report.model import proxy_config

    s = rows[0]["shape"]
    c = proxy_config(experts=s["experts"], topk=s["topk_experts"], layers=s["layers"])
    kept = kept_bytes_per_token(c, "none", kept_kib)
    per_token = sum(kept[k] for k in layer_kinds(c)) + kept["model"]
    beyond = {r["shape"]["tokens"]: r["peak_gib"] * _GiB - per_token * r["shape"]["tokens"] for r in rows}
    (t0, b0), (t1, b1) = (min(beyond.items()), max(beyond.items()))
    slope = (b1 - b0) / (t1 - t0)
    fixed = b0 - slope * t0
    miss = max((abs((fixed + (slope + per_token) * r["shape"]["tokens"]) / (r["peak_gib"] * _GiB) - 1)
                for r in rows[1:-1]), default=0.0)
    return {"fixed_gib": round((fixed - c.workspace_bytes) / _GiB, 4), "kib_per_token": round(slope / 1024, 2)}, miss


def kept_kib(res: Results) -> tuple[dict[str, float], dict[str, Any]]:
    """``KEPT_KIB`` from ``model_kept.json`` (bytes by module: ``model.layers.<i>`` is the layer's own, the two
    stream sets; ``.mlp``, ``.self_attn``, ``.attn_hc`` + ``.ffn_hc`` its parts), and that file."""
    from csattn.parallel.plan.counts import layer_kinds
    from csattn.report.model import proxy_config

    data = res.files.get(KEPT) or {}
    kept, T = data.get("by_component"), data.get("tokens")
    if not kept or not T or data.get("recompute") != "none":
        raise MissingMeasurement(f"the planner's kept bytes need {KEPT} (the proxy, recompute none): measure it "
                                 "(python -m benchmarks.results --measure --stages model)")
    c = proxy_config(experts=data["experts"], topk=data["topk"], layers=data["layers"])
    kinds = layer_kinds(c)[: data["layers"]]

    def kib(*names: str) -> float:
        return sum(kept.get(n, 0) for n in names) / T / 1024

    def mean(part: str, kind: str | None = None) -> float:
        vals = [kib(*(f"model.layers.{i}{p}" for p in part.split("+"))) for i, k in enumerate(kinds)
                if kind in (None, k)]
        return sum(vals) / len(vals)

    out = {"combines": mean(""), "moe": mean(".mlp"),
           **{f"attn_{k}": mean(".self_attn", k) for k in ("sliding", "csa", "hca")},
           "mhc": mean(".attn_hc+.ffn_hc"), "embed": kib("model.embed_tokens"), "head": kib("model.hc_head")}
    return {k: round(v, 2) for k, v in out.items()}, data


def recompute_slowdown(res: Results) -> tuple[dict[str, float], dict[str, tuple[dict, dict]]]:
    """``RECOMPUTE_SLOWDOWN`` from ``model_recompute.json``: each mode's step over the step without recompute at
    the same commit (the file's last such pair), and those pairs by mode."""
    steps: dict[tuple[str, str], dict] = {}
    for r in res.records(RECOMPUTE, op="model", provider="csattn", variant=""):
        if r.get("ms"):
            steps[(r["commit"], r["shape"]["recompute"])] = r
    pairs = {}
    for (commit, mode), r in steps.items():
        if mode in RECOMPUTE_MODES and (commit, "none") in steps:
            pairs.pop(mode, None)
            pairs[mode] = (r, steps[(commit, "none")])  # a later commit's pair replaces an earlier one's
    missing = [m for m in RECOMPUTE_MODES if m not in pairs]
    if missing:
        raise MissingMeasurement(f"the planner's recompute slow-down needs {RECOMPUTE}'s steps with recompute "
                                 f"{missing} beside recompute none at their commit: measure it (python -m "
                                 "benchmarks.results --measure --stages model)")
    return {m: round(pairs[m][0]["ms"] / pairs[m][1]["ms"], 4) for m in RECOMPUTE_MODES}, pairs


def planner_constants(json_dir: Path) -> dict[str, Any]:
    """The constants and what each came from: ``{"MFU_BY_ROWS", "FP8_GEMM_SPEEDUP", "TRANSIENT", "KEPT_KIB",
    "RECOMPUTE_SLOWDOWN", "sources"}``;
    ``MissingMeasurement`` naming the file and the stage to measure when one is missing."""
    res = Results.load(json_dir)
    rows = _proxy_rows(res)
    speedup, moe, moe_commit = _fp8_speedup(res)
    kept, kept_data = kept_kib(res)
    slowdown, pairs = recompute_slowdown(res)
    transient, miss = _transient(rows, kept)
    return {"MFU_BY_ROWS": {r["shape"]["tokens"]: round(r["mfu"], 4) for r in rows},
            "FP8_GEMM_SPEEDUP": speedup, "TRANSIENT": transient, "KEPT_KIB": kept, "RECOMPUTE_SLOWDOWN": slowdown,
            "sources": {"rows": rows, "moe": moe, "moe_commit": moe_commit, "miss": miss, "kept": kept_data,
                        "pairs": pairs}}


def _at(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['file']} at {r['commit']}" for r in {r["file"]: r for r in rows}.values())


def _literal(d: dict) -> str:
    """``d`` as Python source, strings in double quotes (the repository's style)."""
    return "{" + ", ".join(f"{json.dumps(k) if isinstance(k, str) else k}: {v!r}" for k, v in d.items()) + "}"


def _comment(text: str) -> str:
    return textwrap.fill(text, WIDTH, initial_indent="# ", subsequent_indent="# ")


def render_measured(json_dir: Path) -> str:
    """The text of ``measured.py`` from the JSON files of ``json_dir``."""
    k = planner_constants(json_dir)
    rows, by, moe_commit = k["sources"]["rows"], k["sources"]["moe"], k["sources"]["moe_commit"]
    sh = by["bf16"]["shape"]
    experts, top = sh["routing"].split("x")
    peaks = ", ".join(f"{r['shape']['tokens'] // 1024}k {r['peak_gib']:.2f} GiB" for r in rows)
    kept_commit = commit_of({}, k["sources"]["kept"].get("meta"))
    slow_commits = "+".join(dict.fromkeys(r["commit"] for pair in k["sources"]["pairs"].values() for r in pair))
    files = [f"{name} ({commit})" for name, commit in {**{r["file"]: r["commit"] for r in rows},
                                                        FINETUNE: moe_commit, KEPT: kept_commit,
                                                        RECOMPUTE: slow_commits}.items()]
    doc = textwrap.fill(f"The planner's measured constants. GENERATED by ``python -m benchmarks.results`` from "
                        f"benchmarks/results/h200/ {', '.join(files)}, measured at the commits named: do not edit; "
                        "measure again (``python -m benchmarks.results --measure --stages model finetune``) and "
                        "render (``python -m benchmarks.results``). tests/parallel/test_plan_measured.py fails "
                        "when this file is not what those files render (benchmarks/results/planner.py derives each "
                        "constant).", WIDTH)
    mfu = _comment(f"One-GPU MFU of the 4-layer proxy's training step by tokens per step, recompute none "
                   f"({_at(rows)}).")
    fp8 = _comment(f"The rate of the GEMMs of FP8-held frozen weights relative to the bf16 rate the MFU above "
                   f"reflects, by compute mode: the frozen routed experts' forward + input gradient, {experts} experts "
                   f"top-{top}, {sh['tokens'] // 1024}k tokens, D {sh['hidden']}, I {sh['inter']} ({FINETUNE} "
                   f"\"moe\" at {moe_commit}): bf16 grouped {by['bf16']['ms']:.2f} ms over fp8 "
                   f"{by['fp8']['ms']:.2f} ms, w8a16 {by['w8a16']['ms']:.2f} ms.")
    transient = _comment(f"The backward's memory beyond what is kept: the proxy's step peak ({peaks}; recompute none) "
                         "less its kept bytes (KEPT_KIB below), a line through the shortest and the longest: a fixed "
                         "part less the attention core's workspace (its buffers, the kernels' own) and a part per "
                         "token of the rank (stream gradients, one layer's backward temporaries); the lengths between "
                         f"within {k['sources']['miss'] * 100:.1f} %.")
    return (f'"""{doc}"""\n\n__all__ = ["FP8_GEMM_SPEEDUP", "KEPT_KIB", "MFU_BY_ROWS", "RECOMPUTE_SLOWDOWN", '
            '"TRANSIENT"]\n\n'
            f"{mfu}\nMFU_BY_ROWS = {_literal(k['MFU_BY_ROWS'])}\n\n"
            f"{fp8}\nFP8_GEMM_SPEEDUP = {_literal(k['FP8_GEMM_SPEEDUP'])}\n\n"
            f"{transient}\nTRANSIENT = {_literal(k['TRANSIENT'])}\n\n"
            f"{_kept_text(k)}\n\n{_slowdown_text(k)}\n")


# what each component of KEPT_KIB holds (memory.kept_bytes_per_token scales each by the geometry)
KEPT_PARTS = {
    "combines": "the layer's own: two bf16 stream sets [n, D] (scales with n * D)",
    "moe": "routed gate/up [k, 2I] 16 + shared [2I] 8 + output [D] 8 + routing",
    "attn_sliding": "output [D] 8 + query latent, keys (scale with q_lora)",
    "attn_csa": "+ compressed entries, indexer state; top-k ids (int64) and teacher masses (fp32) 6",
    "attn_hca": "+ compressed entries",
    "mhc": "the two sites' logits and scales",
    "embed": "per model: the embedding [D]",
    "head": "per model (and per MTP head): the head's normed output [D]",
}


def _kept_text(k: dict[str, Any]) -> str:
    data = k["sources"]["kept"]
    head = _comment(f"Kept for the backward, KiB per token per layer by component: the {data['layers']}-layer proxy "
                    f"({data['experts']} experts top-{data['topk']}) at {data['tokens'] // 1024}k tokens, recompute "
                    f"none, each layer kind's modules averaged over its layers ({KEPT} at "
                    f"{commit_of({}, data.get('meta'))}; geometry of the measurement: memory.PROXY).")
    rows = [f"    {json.dumps(name)}: {v!r},  # {KEPT_PARTS[name]}" for name, v in k["KEPT_KIB"].items()]
    return f"{head}\nKEPT_KIB = {{\n" + "\n".join(rows) + "\n}"


def _slowdown_text(k: dict[str, Any]) -> str:
    pairs = k["sources"]["pairs"]
    steps = "; ".join(f"{m} {r['ms']:.1f} over {n['ms']:.1f} at {r['commit']}" for m, (r, n) in pairs.items()
                      if m != "none")
    head = _comment(f"Step time of each recompute relative to none, the proxy at "
                    f"{next(iter(pairs.values()))[0]['shape']['tokens'] // 1024}k tokens, ms per step on one GPU, "
                    f"over the step without recompute at the same commit ({RECOMPUTE}: {steps}).")
    return f"{head}\nRECOMPUTE_SLOWDOWN = {_literal(k['RECOMPUTE_SLOWDOWN'])}"


def write_measured(json_dir: Path, path: Path) -> bool:
    """Write ``measured.py`` to ``path`` from ``json_dir``; whether its text changed."""
    text = render_measured(json_dir)
    path = Path(path)
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    return True
