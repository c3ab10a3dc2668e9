"""``benchmarks.results``: the results page from a small set of JSON files (no GPU), the commands it cites, and the
measurement loop's timeout and budget."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from benchmarks.registry import PROVIDERS, load_providers  # noqa: E402
from benchmarks.results import STAGES, Source, render_page, run_stages  # noqa: E402

COMMIT = "abc1234"
META = {"commit": COMMIT, "torch": "2.11.0", "triton": "3.6.0", "device": "NVIDIA H200",
        "date": "2026-12-04 10:00:00 UTC"}


def _runner(path: Path, records: list[dict]) -> None:
    path.write_text(json.dumps({"meta": META, "results": records}))


def _model(tokens: int, ms: float, gib: float, provider: str = "csattn", recompute: str = "none", **extra) -> dict:
    return {"op": "model", "provider": provider, "variant": "", "mode": "fwdbwd", "ms": ms, "peak_gib": gib,
            "shape": {"tokens": tokens, "recompute": recompute}, "tokens_per_s": tokens / ms * 1e3,
            "tflops": 300.0, "mfu": 0.40, **extra}


def _kernel(provider: str, tokens: int, ms: float, gib: float) -> dict:
    return {"provider": provider, "variant": "", "shape": {"tokens": tokens, "topk": 512}, "ms": ms, "peak_gib": gib,
            "tflops": 400.0}


def _layer(layer: str, path: str, cp: int, part: str, rank: int, ms: float, peak: float, act: float | None,
           kind: str = "group") -> dict:
    return {"layer": layer, "tokens": 8192, "path": path, "partition": part, "cp": cp, "rank": rank, "kind": kind,
            "ms": ms, "peak_gib": peak, "act_gib": act, "flops_fwdbwd": 1e13, "rank_model_flops": None}


def _report(path: Path, records: list[dict]) -> None:
    meta = {**META, "date": "2026-12-04 10:00 UTC", "dtype": "bfloat16", "geometry": "real", "steps": 2}
    path.write_text(json.dumps({"meta": meta, "records": records}))


@pytest.fixture
def json_dir(tmp_path: Path) -> Path:
    d = tmp_path / "json"
    d.mkdir()
    _runner(d / "model.json", [_model(16384, 300.0, 9.6), _model(65536, 1300.0, 34.0)])
    _runner(d / "model_128k.json", [_model(131072, 2700.0, 66.0)])
    _runner(d / "model_512k.json", [_model(524288, 30000.0, 127.0, recompute="full+offload",
                                           info={"steps_ms": [50000.0, 30000.0]})])
    _runner(d / "model_hf.json", [_model(6144, 125.0, 4.8), _model(6144, 150.0, 5.4, provider="hf_patched"),
                                  _model(6144, 900.0, 108.0, provider="hf")])
    _runner(d / "sparse_attn_bwd.json", [_kernel("triton", 32768, 16.0, 2.0), _kernel("cudnn", 32768, 17.6, 2.0)])
    _runner(d / "indexer_topk.json", [_kernel("triton", 32768, 4.0, 0.5), _kernel("cudnn", 32768, 5.0, 3.0)])
    _runner(d / "sparse_attn_fwd.json", [_kernel("triton", 32768, 5.3, 2.0)])
    _runner(d / "layer_step.json", [{"provider": p, "variant": "", "shape": {"tokens": 4096}, "ms": m}
                                    for p, m in (("eager", 20.0), ("capture_safe", 24.0), ("graph", 16.0))])
    _report(d / "report_cp1.json", [_layer("csa", "triton", 1, "contiguous", 0, 40.0, 1.4, 0.2),
                                    _layer("csa", "unfused", 1, "contiguous", 0, 800.0, 7.0, 3.0),
                                    _layer("csa", "hf", 1, "contiguous", 0, 240.0, 9.8, None)])
    _runner(d / "deterministic_kernels.json", [_kernel("triton", 32768, 16.0, 2.0),
                                                {**_kernel("triton", 32768, 20.0, 2.1), "variant": "deterministic=1"},
                                                {**_kernel("triton", 32768, 40.0, 2.1),
                                                 "variant": "deterministic=1,bwd_gluon=0"}])
    det = {**_kernel("triton", 32768, 9.0, 0.5), "variant": "deterministic=1"}
    _runner(d / "deterministic_indexer_loss.json", [_kernel("triton", 32768, 7.5, 0.5), det])
    _runner(d / "model_deterministic.json", [{**_model(16384, 330.0, 9.6), "variant": "deterministic"}])
    _runner(d / "model_deterministic_base.json", [_model(16384, 300.0, 9.6)])
    _runner(d / "model_recompute.json", [_model(16384, 300.0, 9.6), _model(16384, 330.0, 5.0, recompute="block")])
    kib = 1024 * 1024  # bytes of 1 KiB per token at 1024 tokens
    kept_parts = {"": 64, ".mlp": 34, ".self_attn": 16, ".attn_hc": 0.25, ".ffn_hc": 0.25}
    (d / "model_kept.json").write_text(json.dumps({
        "meta": META, "tokens": 1024, "layers": 4, "recompute": "none", "experts": 8, "topk": 2,
        "by_component": {**{f"model.layers.{i}{p}": v * kib for i in range(4) for p, v in kept_parts.items()},
                         "model.embed_tokens": 8 * kib, "model.hc_head": 8 * kib}}))
    _runner(d / "soak_deterministic.json", [{
        "steps": 240, "wall_s": 316.0, "kills": [{"after_s": 120.5, "last_step_logged": 81},
                                                {"after_s": 215.8, "last_step_logged": 161}],
        "loss_first_last": [11.19, 1.82], "bitwise_equal_losses": {"killed": True, "again": True},
        "bitwise_equal_weights": {"killed": True, "again": False}, "peak_gib_min_max_after_step_3": [14.96, 14.98]}])
    parts = [(part, r) for part in ("contiguous", "balanced") for r in range(4)]
    _report(d / "report_cp4.json", [*(_layer("csa", "triton", 4, part, r, 60.0, 1.0, 0.05) for part, r in parts),
                                    *(_layer("csa", "triton", 4, part, r, 10.0 + r, 0.3, None, kind="isolated")
                                      for part, r in parts)])
    return d


def _render(tmp_path: Path, json_dir: Path) -> str:
    return render_page(json_dir, tmp_path / "BENCHMARKS.md", tmp_path / "docs" / "benchmarks",
                       tmp_path / "docs" / "report")


def test_page_from_json_alone(tmp_path, json_dir):
    md = _render(tmp_path, json_dir)
    assert (tmp_path / "BENCHMARKS.md").read_text() == md
    lines = md.splitlines()
    assert lines[0] == "# Benchmarks" and len(lines) <= 250
    assert f"at commit `{COMMIT}`" in lines[2] and "NVIDIA H200" in lines[2]  # one commit, one machine, first screen
    headline = md.split("## ")[0]
    for row in ("| 16k | none | 54.6k |", "| 64k |", "| 128k |", "| 512k | full+offload |"):
        assert row in headline
    # each comparison: csattn's numbers, the baseline's, and both ratios (baseline / csattn)
    assert "| [HF model patched onto csattn, 6k tokens](#hf-integration) | 150.0 ms, 5.40 GiB | HF eager: 900.0 ms, " \
           "108.00 GiB | 6.00x | 20.0x |" in headline
    assert "unfused PyTorch: 800.0 ms, 7.00 GiB | 20.0x | 5.00x |" in headline
    assert "HF eager: 240.0 ms, 9.80 GiB | 6.00x | 7.00x |" in headline
    assert "cuDNN: 17.6 ms, 2.00 GiB | 1.10x | 1.00x |" in headline
    assert "CP = 1: 0.20 GiB kept, 1.40 GiB peak | - | 4.00x |" in headline
    assert "eager: 20.0 ms | 1.25x | - |" in headline
    for title in ("Model step", "HF integration", "Layer", "Context parallelism", "Kernels against cuDNN",
                  "CUDA-graph step", "Deterministic mode", "Method"):
        assert f"\n## {title}\n" in md
    for row in ("| sparse-attention backward | 32k | 16.0 | 20.0 | 1.25x |",
                "| sparse-attention backward, Triton pair | 32k | 16.0 | 40.0 | 2.50x |",
                "| killed twice and resumed | yes | yes |", "| a second uninterrupted run | yes | **no** |",
                "killed with SIGKILL after steps 81 and 161",
                "| indexer-loss backward | 32k | 7.500 | 9.000 | 1.20x |",
                "| proxy training step | 16k | 300.0 | 330.0 | 1.10x |",
                "| block | `abc1234` | 16k | 330.0 | 1.10x | 5.00 |", "| mhc | 0.50 |", "| attn_hca | 16.00 |"):
        assert row in md
    # every table names the JSON it comes from and the command that writes it
    for name in ("model.json", "model_512k.json", "model_hf.json", "report_cp1.json", "sparse_attn_bwd.json",
                 "layer_step.json"):
        assert f"]({Path('json').as_posix()}/{name})" in md
    for src in (s for runs in STAGES.values() for s in runs
                if s.file not in ("sharded.json", "finetune.json")):  # this fixture has none
        assert src.command() in md
    assert "| 1.000 / 1.000 |" not in md and "| 1.300 / 1.300 |" in md  # per-rank balance: 13 / 10 ms
    assert (tmp_path / "docs" / "benchmarks" / "model_step.png").stat().st_size > 0
    for name in ("report.json", "report.md", "time.png", "memory.png"):
        assert (tmp_path / "docs" / "report" / name).exists()
    assert "## Sharded training" not in md


def test_sharded_table_when_present(tmp_path, json_dir):
    (json_dir / "sharded.json").write_text(json.dumps({"meta": META, "results": [
        {"mesh": "dp_shard=4", "ranks": 4, "tokens_per_s": 200000.0, "mfu": 0.41, "peak_gib": 50.0,
         "planned_gib": 52.0}]}))
    md = _render(tmp_path, json_dir)
    assert "\n## Sharded training\n" in md
    assert "| dp_shard=4 | 4 | 200,000 | 41.0% | 50.00 | 52.00 | 1.04x |" in md
    assert "    python -m benchmarks.sharded --json sharded.json" in md


def test_missing_files_leave_their_sections_out(tmp_path, json_dir):
    for f in json_dir.glob("*.json"):
        if f.name not in ("model.json", "layer_step.json"):
            f.unlink()
    md = _render(tmp_path, json_dir)
    assert "\n## Model step\n" in md and "\n## CUDA-graph step\n" in md
    for title in ("HF integration", "Layer", "Context parallelism", "Kernels against cuDNN"):
        assert f"\n## {title}\n" not in md


def test_several_commits_are_named(tmp_path, json_dir):
    data = json.loads((json_dir / "layer_step.json").read_text())
    data["meta"]["commit"] = "def5678"
    (json_dir / "layer_step.json").write_text(json.dumps(data))
    md = _render(tmp_path, json_dir)
    assert "at 2 commits" in md.splitlines()[2] and "`def5678`" in md


def test_stages_name_registered_ops_and_providers():
    from benchmarks.run import _split_providers

    load_providers()
    files = [s.file for runs in STAGES.values() for s in runs]
    assert len(files) == len(set(files)) and "sharded" in STAGES
    for src in (s for runs in STAGES.values() for s in runs if s.module == "benchmarks.run"):
        args = list(src.args)
        op, providers = args[args.index("--op") + 1], _split_providers(args[args.index("--providers") + 1])
        names = {name for name, _ in providers}  # name[variant]: the variant is the provider's to take
        assert names <= set(PROVIDERS[op]), (src.file, providers)


def test_measure_keeps_budget_and_timeouts(tmp_path, monkeypatch):
    (tmp_path / "fake_bench.py").write_text(textwrap.dedent("""
        import json, sys, time
        args = sys.argv[1:]
        time.sleep(float(args[0]))
        json.dump({"meta": {"commit": args[args.index("--commit") + 1]}, "results": []},
                  open(args[args.index("--json") + 1], "w"))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(sys.path))
    stages = {"quick": (Source("quick.json", "fake_bench", ("0",), 30),),
              "slow": (Source("slow.json", "fake_bench", ("30",), 1),),
              "late": (Source("late.json", "fake_bench", ("0",), 30),)}
    monkeypatch.setattr("benchmarks.results.measure.STAGES", stages)
    monkeypatch.setattr("benchmarks.results.measure.MIN_START_S", 0.5)
    log = run_stages(["quick", "slow"], tmp_path / "out", COMMIT)
    assert [e["rc"] for e in log] == [0, 124]
    assert json.loads((tmp_path / "out" / "quick.json").read_text())["meta"]["commit"] == COMMIT
    log = run_stages(["late"], tmp_path / "out", COMMIT, budget_s=0.1)
    assert "skipped" in log[0]
    with pytest.raises(ValueError, match="unknown stages"):
        run_stages(["nope"], tmp_path / "out", COMMIT)
