"""``csattn report`` end to end on a tiny geometry (CPU, gloo): JSON, Markdown and plots are written."""

import json
from argparse import Namespace

import pytest

pytest.importorskip("matplotlib")

from csattn.cli import build_parser  # noqa: E402
from csattn.models.deepseek_v4.flops import layer_flops  # noqa: E402
from csattn.report import plan_groups, ragged_lengths, report_config  # noqa: E402


def test_ragged_lengths_fill_exactly():
    for tokens in (128, 4096, 131072):
        lengths = ragged_lengths(tokens)
        assert sum(lengths) == tokens and len(lengths) > 1 and min(lengths) >= 1


def test_flops_grow_with_visible_entries():
    cfg = report_config("csa", "real", "reference")
    short, long = layer_flops(cfg, [4096] * 8), layer_flops(cfg, [32768])
    assert long["fwd"] > short["fwd"]  # same tokens, more visible entries for the indexer
    assert short["bwd"] > short["fwd"]


def test_plan_groups_caps_paths():
    args = Namespace(cp=[1, 2], partitions=["contiguous", "balanced"], paths=["triton", "reference", "hf"],
                     device="cuda", reference_max_tokens=8192, hf_max_tokens=4096, layers=["csa"],
                     tokens=[4096, 8192, 16384])
    groups = plan_groups(args)
    assert [(s, p) for s, p, _ in groups] == [(1, "contiguous"), (2, "contiguous"), (2, "balanced")]
    cp1 = groups[0][2]
    assert {j.path for j in cp1} == {"triton", "reference", "hf"}
    assert max(j.tokens for j in cp1 if j.path == "hf") == 4096
    assert all(j.path != "hf" for _, _, jobs in groups[1:] for j in jobs)
    assert max(j.tokens for j in groups[1][2] if j.path == "reference") == 8192
    args.reference_cp_max_tokens = 4096  # the reference's longest stream at CP > 1 only
    groups = plan_groups(args)
    assert max(j.tokens for j in groups[0][2] if j.path == "reference") == 8192
    assert max(j.tokens for j in groups[1][2] if j.path == "reference") == 4096


@pytest.mark.slow  # spawned ranks
@pytest.mark.timeout(300)
def test_report_runs_tiny(tmp_path, capsys):
    from csattn.report import run_report

    args = build_parser().parse_args([
        "report", "--geometry", "tiny", "--dtype", "float32", "--tokens", "128", "--cp", "1", "2",
        "--layers", "hca", "--paths", "reference", "unfused", "hf", "--partitions", "contiguous", "--steps", "1",
        "--hf-max-tokens", "0", "--model-tokens", "256", "--model-routing", "8x2", "--hf-model-max-tokens", "256",
        "--device", "cpu", "--out", str(tmp_path)])
    assert run_report(args) == 0
    assert f"wrote report.json, report.md and PNG plots to {tmp_path}" in capsys.readouterr().out
    data = json.loads((tmp_path / "report.json").read_text())
    kinds = {(r["kind"], r["cp"]) for r in data["records"] if "error" not in r}
    assert {("group", 1), ("group", 2), ("isolated", 2)} <= kinds
    md = (tmp_path / "report.md").read_text()
    assert "| hca | 128 | reference | 2 | contiguous |" in md
    assert "| hca | 128 | unfused | 1 | - |" in md
    assert "- HCA unfused, CP=1: longest stream run 128 tokens" in md
    # the model rows: csattn on ragged documents and HF eager on one, one training step each
    model = {r["path"]: r for r in data["records"] if r["kind"] == "model"}
    assert set(model) == {"csattn", "hf"} and all("error" not in r for r in model.values()), model
    assert model["csattn"]["docs"] == [32, 96, 128] and model["hf"]["docs"] == [256]
    assert model["csattn"]["tflops"] > 0 and model["csattn"]["tokens_per_s"] > 0
    assert "| model 8x2 | 256 | csattn |" in md and "| model 8x2 | 256 | hf |" in md
    for png in ("memory.png", "time.png", "balance.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_default_output_is_a_new_directory_not_the_committed_report():
    args = build_parser().parse_args(["report"])
    assert args.out == "csattn-report"
    assert build_parser().parse_args(["report", "--output", "x"]).out == "x"


def test_gpu_sized_report_on_cpu_is_refused_without_force(tmp_path):
    from csattn.report import run_report

    out = tmp_path / "r"
    args = build_parser().parse_args(["report", "--device", "cpu", "--out", str(out)])
    with pytest.raises(ValueError, match=r"--device cpu: \d+ cases of the V4-Flash .*--geometry tiny.*--force"):
        run_report(args)
    assert not out.exists()  # refused before writing anything


def test_merge_reports_later_cases_replace_earlier(tmp_path):
    import json

    from csattn.report.run import merge_reports

    def rec(cp, tokens, peak, rank=0, part="contiguous"):
        return {"kind": "group", "layer": "csa", "tokens": tokens, "path": "triton", "cp": cp, "partition": part,
                "rank": rank, "ms": 1.0, "peak_gib": peak, "act_gib": peak / 2, "flops_fwdbwd": 1e12}

    meta = {"device": "gpu", "dtype": "bfloat16", "geometry": "real", "date": "d", "steps": 1}
    first = {"meta": {**meta, "commit": "aaa"}, "records": [rec(1, 4096, 8.0), rec(2, 4096, 5.0),
                                                           rec(2, 4096, 5.5, rank=1)]}
    second = {"meta": {**meta, "commit": "bbb"}, "records": [rec(1, 4096, 4.0), rec(4, 4096, 1.0)]}
    paths = []
    for i, data in enumerate((first, second)):
        paths.append(str(tmp_path / f"r{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(data, f)
    md = merge_reports(paths, str(tmp_path / "out"))
    merged = json.loads((tmp_path / "out" / "report.json").read_text())
    peaks = sorted((r["cp"], r["rank"], r["peak_gib"]) for r in merged["records"])
    assert peaks == [(1, 0, 4.0), (2, 0, 5.0), (2, 1, 5.5), (4, 0, 1.0)]
    assert merged["meta"]["commit"] == "aaa + bbb"
    assert "| 4.00 |" in md  # CP1/CP4 peak ratio from the replaced CP=1 case: 4.0 / 1.0
    # rows from two commits: each row names its own
    commits = {(r["cp"], r["commit"]) for r in merged["records"]}
    assert commits == {(1, "bbb"), (2, "aaa"), (4, "bbb")}
    assert "| commit |" in md and "| 2 | contiguous |" in md
    row_cp2 = next(line for line in md.splitlines() if "| 2 | contiguous |" in line)
    assert row_cp2.endswith(" aaa |")


def test_tiny_report_on_cpu_queues_what_a_cpu_runs():
    """``csattn report --geometry tiny`` on a CPU (the README's hint) used to queue the GPU's 116 cases up to 128k
    tokens and write nothing for ten minutes; it now takes CPU-sized defaults (a minute or two end to end), while
    every option given on the command line, and the GPU's defaults, stay as they are."""
    from csattn.report.run import GPU_DEFAULTS, plan_model_jobs, resolve_defaults

    args = resolve_defaults(build_parser().parse_args(["report", "--geometry", "tiny", "--device", "cpu"]))
    groups, model = plan_groups(args), plan_model_jobs(args)
    jobs = [j for _, _, js in groups for j in js]
    assert len(jobs) + len(model) <= 40, (len(jobs), len(model))
    assert max(j.tokens for j in jobs) <= 256 and max(t for _, t, _, _ in model) <= 256
    assert all(j.path != "triton" for j in jobs) and args.steps == 1
    # what the user sets wins; the GPU keeps its sizes
    args = resolve_defaults(build_parser().parse_args(["report", "--geometry", "tiny", "--device", "cpu", "--tokens",
                                                       "512", "--steps", "2"]))
    assert args.tokens == [512] and args.steps == 2 and args.cp == [1, 2]
    args = resolve_defaults(build_parser().parse_args(["report", "--device", "cuda"]))
    assert {k: getattr(args, k) for k in GPU_DEFAULTS} == GPU_DEFAULTS
    args = resolve_defaults(build_parser().parse_args(["report", "--geometry", "tiny", "--device", "cuda"]))
    assert args.tokens == GPU_DEFAULTS["tokens"]
