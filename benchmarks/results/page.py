"""``BENCHMARKS.md`` from the JSON files alone: the headline tables, one section per measurement, the plots."""

from __future__ import annotations

import os
from pathlib import Path

from .data import Results, times
from .finetune import QUALITY, QUALITY_PLOT, finetune_section
from .plots import loss_plot, model_plot
from .readme import fill_readme, readme_paragraphs
from .sections import (
    Claim,
    Context,
    Section,
    cp_section,
    deterministic_section,
    graphs_section,
    hf_section,
    kernels_section,
    layer_section,
    model_headline,
    model_section,
    planner_inputs_section,
    sharded_section,
)
from .sources import REPORT_PARTS, listed_stages

__all__ = ["render_page"]

SECTIONS = (model_section, hf_section, layer_section, cp_section, kernels_section, graphs_section, sharded_section,
            deterministic_section, finetune_section, planner_inputs_section)


def _link(target: Path, page: Path) -> str:
    return Path(os.path.relpath(target, page.parent)).as_posix()


def _merge_report(res: Results, report_dir: Path) -> list[dict]:
    """Merge the report's parts into ``report_dir`` (its report.json, report.md and plots) and return its records."""
    parts = [str(res.json_dir / p) for p in REPORT_PARTS if p in res.files]
    if not parts:
        return []
    import contextlib
    import io
    import json

    from csattn.report.run import merge_reports

    with contextlib.redirect_stdout(io.StringIO()):
        merge_reports(parts, str(report_dir))
    with open(report_dir / "report.json") as f:
        return json.load(f)["records"]


def _commits(res: Results, report: list[dict]) -> dict[str, None]:
    found: dict[str, None] = {}
    for name in res.files:
        for r in res.records(name):
            found[r["commit"]] = None
    for r in report:
        if r.get("commit"):
            found[str(r["commit"])] = None
    return found


def _header(res: Results, report: list[dict]) -> list[str]:
    metas = [m for m in (res.meta(n) for n in res.files) if m and m.get("triton")]  # the runner's: versions
    meta = max(metas, key=lambda m: str(m.get("date", ""))) if metas else {}
    commits = list(_commits(res, report))
    if len(commits) == 1:
        at = f"at commit `{commits[0]}`"
    else:
        at = (f"at {len(commits)} commits ({', '.join(f'`{c}`' for c in commits)}; each section names its own: "
              "re-run the measurement below to bring them to one)")
    stages = " ".join(listed_stages(res.files))
    return ["# Benchmarks", "",
            f"Measured on one {meta.get('device', '?')} (torch {meta.get('torch', '?')}, Triton "
            f"{meta.get('triton', '?')}) {at}. Every table is rendered from the JSON it names by "
            "`python -m benchmarks.results --out BENCHMARKS.md` (no GPU), which also writes the README's figures "
            f"from the same files; `python -m benchmarks.results --measure --stages {stages}` measures them all on a "
            "GPU. How these numbers came to be: [`lab/`](lab/README.md)."]


def _claims_table(claims: list[Claim]) -> list[str]:
    rows = [f"| [{c.what}]({c.anchor}) | {c.ours} | {c.baseline} | {times(c.speed)} | {times(c.memory)} |"
            for c in claims]
    return ["| csattn | measured | against | faster | less memory |", "| --- | --- | --- | ---: | ---: |", *rows]


def render_page(json_dir: Path, page: Path, plots_dir: Path, report_dir: Path, readme: Path | None = None) -> str:
    """Write ``page`` (Markdown) from the JSON files of ``json_dir``; the model plot goes to ``plots_dir``, the
    merged scaling report (its table and plots) to ``report_dir``; with ``readme``, rewrite that README's figure
    paragraphs from the same files (:mod:`benchmarks.results.readme`). Returns the page's Markdown."""
    json_dir, page, plots_dir, report_dir = (Path(p) for p in (json_dir, page, plots_dir, report_dir))
    res = Results.load(json_dir)
    report = _merge_report(res, report_dir)
    ctx = Context(res, _link(json_dir, page), _link(report_dir, page), _link(plots_dir, page), report)
    sections: list[Section] = [s for s in (build(ctx) for build in SECTIONS) if s is not None]
    model = [r for f in ("model.json", "model_128k.json", "model_512k.json") for r in res.records(f)]
    model_plot(model, plots_dir / "model_step.png")
    loss_plot((res.files.get(QUALITY) or {}).get("losses", []), plots_dir / QUALITY_PLOT,
              "LoRA on the V4-Flash slice, FP8 base, real text (2k tokens a step), one H200")
    claims = [c for s in sections for c in s.claims]
    lines = _header(res, report)
    head = model_headline(res)
    if head:
        lines += ["", "**Training step of the 4-layer DeepSeek-V4-Flash proxy** (1.64 B parameters, 8 experts top-2, "
                  f"packed documents) on one GPU ([details]({Section('Model step', []).anchor})):", "", *head]
    if claims:
        lines += ["", "**Against the baselines** (ratios above 1 favour csattn):", "", *_claims_table(claims)]
    for s in sections:
        lines += ["", f"## {s.title}", "", *s.lines]
    lines += ["", "## Method", "",
              "Times are medians of `triton.testing.do_bench` (L2 flushed between calls) unless a table says "
              "otherwise; the longest model steps are timed one step after a warm-up. TFLOP/s count the useful "
              "matrix products (`csattn.models.deepseek_v4.flops.layer_flops` / `model_flops`: real tokens, the "
              "keys each row sees, recomputation not counted); MFU = TFLOP/s / 790, the H200's measured dense "
              "bf16 rate. Memory is `torch.cuda.max_memory_allocated` above what was allocated before the measured "
              "call.", "",
              "Measure every file at one commit (a GPU with the `cudnn` provider's package and transformers >= 5.23; "
              "`--budget-s` stops starting commands near a time limit), then render anywhere:", "",
              f"    python -m benchmarks.results --measure --json-dir {ctx.json_link} --stages "
              + " ".join(listed_stages(res.files)), "    python -m benchmarks.results --out BENCHMARKS.md"]
    text = "\n".join(lines) + "\n"
    if readme is not None:  # before the page is written: a README with wrong markers fails with the page unchanged
        readme = Path(readme)
        filled = fill_readme(readme.read_text(), readme_paragraphs(ctx, _link(page, readme)))
    page.write_text(text)
    if readme is not None:
        readme.write_text(filled)
    return text
