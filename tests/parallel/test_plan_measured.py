"""The planner's measured constants (``csattn/parallel/plan/measured.py``) are what ``python -m benchmarks.results``
renders from ``benchmarks/results/h200/`` now, and the planner reproduces the measurements they come from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.results.planner import MEASURED, MissingMeasurement, planner_constants, render_measured
from csattn.parallel.mesh import ParallelDims
from csattn.parallel.plan import (
    FP8_GEMM_SPEEDUP,
    KEPT_KIB,
    MFU_BY_ROWS,
    RECOMPUTE_SLOWDOWN,
    TRANSIENT,
    kept_bytes_per_token,
    mfu_at,
    plan,
)

ROOT = Path(__file__).resolve().parents[2]
JSON_DIR = ROOT / "benchmarks" / "results" / "h200"


def test_measured_module_is_what_the_results_render():
    assert (ROOT / MEASURED).read_text() == render_measured(JSON_DIR), (
        f"{MEASURED} is not what benchmarks/results/h200/ renders now: run python -m benchmarks.results")


def test_constants_are_the_measurements():
    """Each constant is the figure its file holds: the proxy's MFU per length, bf16's time over each FP8 mode's."""
    for name in ("model.json", "model_128k.json"):
        for r in json.loads((JSON_DIR / name).read_text())["results"]:
            assert MFU_BY_ROWS[r["shape"]["tokens"]] == pytest.approx(r["mfu"], abs=1e-4)
            assert mfu_at(r["shape"]["tokens"]) == pytest.approx(MFU_BY_ROWS[r["shape"]["tokens"]])
    moe = {r["provider"]: r["ms"] for r in json.loads((JSON_DIR / "finetune.json").read_text())["moe"]["records"]}
    assert FP8_GEMM_SPEEDUP == pytest.approx({"fp8": moe["bf16"] / moe["fp8"], "w8a16": moe["bf16"] / moe["w8a16"]},
                                             abs=1e-4)


def test_kept_and_recompute_constants_are_the_measurements():
    """``KEPT_KIB`` is ``model_kept.json``'s bytes per token (each layer kind's modules, the embedding and the head);
    ``RECOMPUTE_SLOWDOWN`` is each recompute's step over the step without recompute at its commit."""
    kept = json.loads((JSON_DIR / "model_kept.json").read_text())
    by, T = kept["by_component"], kept["tokens"]
    assert kept["meta"]["commit"] and (kept["recompute"], kept["layers"]) == ("none", 4)

    def kib(name: str) -> float:
        return by[name] / T / 1024

    # the proxy's layers: sliding, CSA, HCA, CSA
    assert KEPT_KIB == pytest.approx({
        "combines": sum(kib(f"model.layers.{i}") for i in range(4)) / 4,
        "moe": sum(kib(f"model.layers.{i}.mlp") for i in range(4)) / 4,
        "attn_sliding": kib("model.layers.0.self_attn"),
        "attn_csa": (kib("model.layers.1.self_attn") + kib("model.layers.3.self_attn")) / 2,
        "attn_hca": kib("model.layers.2.self_attn"),
        "mhc": sum(kib(f"model.layers.{i}.attn_hc") + kib(f"model.layers.{i}.ffn_hc") for i in range(4)) / 4,
        "embed": kib("model.embed_tokens"), "head": kib("model.hc_head")}, abs=5e-3)
    from csattn.parallel.plan.counts import layer_kinds
    from csattn.report.model import proxy_config

    c = proxy_config()  # at the measured geometry the planner's kept bytes are the measured total
    per = kept_bytes_per_token(c, "none")
    assert (sum(per[k] for k in layer_kinds(c)) + per["model"]) * T == pytest.approx(kept["total_bytes"], rel=1e-3)
    steps = {(r["commit"], r["shape"]["recompute"]): r["ms"]
             for r in json.loads((JSON_DIR / "model_recompute.json").read_text())["results"]}
    assert set(RECOMPUTE_SLOWDOWN) == {"none", "mhc", "moe", "block", "full"} and RECOMPUTE_SLOWDOWN["none"] == 1.0
    for (commit, mode), ms in steps.items():  # one commit per recompute in this file, none beside each
        if mode != "none":
            assert RECOMPUTE_SLOWDOWN[mode] == pytest.approx(ms / steps[(commit, "none")], abs=1e-4), mode


def test_planned_backward_memory_passes_through_the_measured_peaks():
    """On the proxy (one GPU, recompute none) the planned kept activations plus workspaces are the measured step
    peak at the shortest and longest lengths, and within 1 % between (``TRANSIENT`` is their line)."""
    from csattn.report.model import proxy_config

    c = proxy_config()
    rows = [r for name in ("model.json", "model_128k.json")
            for r in json.loads((JSON_DIR / name).read_text())["results"]]
    for r in rows:
        p = plan(c, ParallelDims(world=1), r["shape"]["tokens"])
        planned = (p.memory.activations_kept + p.memory.workspaces) / 2**30
        ends = r["shape"]["tokens"] in (min(MFU_BY_ROWS), max(MFU_BY_ROWS))
        assert planned == pytest.approx(r["peak_gib"], rel=1e-4 if ends else 1e-2), (r["shape"]["tokens"], TRANSIENT)


def test_a_changed_measurement_changes_the_module(tmp_path):
    """Not vacuous: a re-measured MFU renders another module; a missing measurement names its file and stage."""
    json_dir = tmp_path / "h200"
    shutil.copytree(JSON_DIR, json_dir)
    data = json.loads((json_dir / "model.json").read_text())
    data["results"][0]["mfu"] = 0.5
    (json_dir / "model.json").write_text(json.dumps(data))
    k = planner_constants(json_dir)
    assert k["MFU_BY_ROWS"][data["results"][0]["shape"]["tokens"]] == 0.5
    assert render_measured(json_dir) != (ROOT / MEASURED).read_text()
    kept = json.loads((json_dir / "model_kept.json").read_text())
    kept["by_component"]["model.layers.2.self_attn"] *= 2
    (json_dir / "model_kept.json").write_text(json.dumps(kept))
    assert planner_constants(json_dir)["KEPT_KIB"]["attn_hca"] == pytest.approx(2 * KEPT_KIB["attn_hca"], abs=0.01)
    steps = json.loads((json_dir / "model_recompute.json").read_text())
    full = next(r for r in steps["results"] if r["shape"]["recompute"] == "full")
    full["ms"] *= 2
    (json_dir / "model_recompute.json").write_text(json.dumps(steps))
    k = planner_constants(json_dir)
    assert k["RECOMPUTE_SLOWDOWN"]["full"] == pytest.approx(2 * RECOMPUTE_SLOWDOWN["full"], abs=1e-3)
    assert k["TRANSIENT"] != TRANSIENT  # derived with the kept bytes of the JSON, not the module's
    steps["results"] = [r for r in steps["results"] if r["shape"]["recompute"] != "full"]
    (json_dir / "model_recompute.json").write_text(json.dumps(steps))
    with pytest.raises(MissingMeasurement, match=r"model_recompute\.json.*'full'.*--stages model"):
        render_measured(json_dir)
    (json_dir / "model_kept.json").unlink()
    with pytest.raises(MissingMeasurement, match=r"model_kept\.json.*--stages model"):
        render_measured(json_dir)
    ft = json.loads((json_dir / "finetune.json").read_text())
    del ft["moe"]
    (json_dir / "finetune.json").write_text(json.dumps(ft))
    with pytest.raises(MissingMeasurement, match=r"finetune\.json.*--stages finetune"):
        render_measured(json_dir)
    (json_dir / "model_128k.json").unlink()
    data["results"] = data["results"][:1]
    (json_dir / "model.json").write_text(json.dumps(data))
    with pytest.raises(MissingMeasurement, match=r"two lengths.*--stages model"):
        render_measured(json_dir)
