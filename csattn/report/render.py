"""Markdown tables and matplotlib plots of the scaling report."""

from __future__ import annotations

import os
from collections import defaultdict

__all__ = ["render_report"]


def _fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _isolated(records: list[dict]) -> dict:
    """(layer, tokens, cp, partition) -> per-rank isolated ms and model FLOPs, rank order."""
    out: dict[tuple, dict] = defaultdict(lambda: {"ms": {}, "flops": {}})
    for r in records:
        if r.get("kind") == "isolated" and "error" not in r:
            key = (r["layer"], r["tokens"], r["cp"], r["partition"])
            out[key]["ms"][r["rank"]] = r["ms"]
            out[key]["flops"][r["rank"]] = r.get("rank_model_flops")
    return dict(out)


def render_report(meta: dict, records: list[dict], out_dir: str) -> str:
    """Write ``report.md`` and PNG plots into ``out_dir``; return the Markdown."""
    from .run import summarize

    summary = summarize(records)
    lines = [
        f"Device: {meta['device']}, dtype {meta['dtype']}, geometry {meta['geometry']}, commit {meta['commit']}, "
        f"{meta['date']}; median of {meta['steps']} steps after one warm-up; one layer forward + backward on a "
        "ragged packed batch; peak = per-rank peak allocated during a step above what was allocated before "
        "it (activations, gradients, workspaces), max over ranks; act. = per-rank memory the forward keeps for "
        "the backward (allocated after the forward minus before it, the output included), max over ranks.",
        "",
        "| layer | tokens | path | CP | partition | peak GiB/rank | CP1/CPn peak | act. GiB/rank | CP1/CPn act. "
        "| ms/step | TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(summary, key=lambda k: (k[0], k[2], k[1], k[3], k[4])):
        layer, tokens, path, cp, part = key
        s = summary[key]
        if "error" in s and "ms" not in s:
            lines.append(f"| {layer} | {tokens} | {path} | {cp} | {part} | {s['error']} | | | | | |")
            continue
        base = summary.get((layer, tokens, path, 1, "-"), {})
        ratios = [base.get(m) / s[m] if base.get(m) and s.get(m) and cp > 1 else None
                  for m in ("peak_gib", "act_gib")]
        lines.append(f"| {layer} | {tokens} | {path} | {cp} | {part} | {_fmt(s.get('peak_gib'))} | "
                     f"{_fmt(ratios[0]) if cp > 1 else ''} | {_fmt(s.get('act_gib'))} | "
                     f"{_fmt(ratios[1]) if cp > 1 else ''} | {_fmt(s.get('ms'), '.1f')} | "
                     f"{_fmt(s.get('tflops'), '.1f')} |")
    iso = _isolated(records)
    if iso:
        lines += ["", "Per-rank work balance (each rank timed alone, fake process group; model FLOPs of its rows):",
                  "", "| layer | tokens | CP | partition | per-rank ms | max/min time | max/min FLOPs |",
                  "|---|---|---|---|---|---|---|"]
        for (layer, tokens, cp, part), v in sorted(iso.items()):
            ms = [v["ms"][r] for r in sorted(v["ms"])]
            fl = [f for f in (v["flops"][r] for r in sorted(v["flops"])) if f]
            fl_ratio = max(fl) / min(fl) if fl and min(fl) > 0 else None
            lines.append(f"| {layer} | {tokens} | {cp} | {part} | {', '.join(f'{m:.1f}' for m in ms)} | "
                         f"{max(ms) / min(ms):.3f} | {_fmt(fl_ratio, '.3f')} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(md)
    _plots(summary, iso, out_dir)
    return md


def _plots(summary: dict, iso: dict, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted({k[0] for k in summary})
    for metric, ylabel, fname in (("peak_gib", "peak GiB per rank", "memory.png"),
                                  ("act_gib", "activation GiB per rank (kept for the backward)", "activations.png"),
                                  ("ms", "ms per step (fwd + bwd)", "time.png")):
        if metric == "act_gib" and not any(s.get(metric) is not None for s in summary.values()):
            continue  # measured on CUDA only
        fig, axes = plt.subplots(1, max(1, len(layers)), figsize=(6 * max(1, len(layers)), 4.5), squeeze=False)
        for ax, layer in zip(axes[0], layers):
            series = defaultdict(list)
            for (ly, tokens, path, cp, part), s in summary.items():
                if ly == layer and s.get(metric) is not None:
                    series[(path, cp, part)].append((tokens, s[metric]))
            for (path, cp, part), pts in sorted(series.items()):
                pts.sort()
                label = f"{path} CP={cp}" + (f" {part}" if cp > 1 else "")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label,
                        linestyle="-" if part in ("-", "contiguous") else "--")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("packed tokens")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{layer.upper()} layer")
            ax.grid(True, which="both", alpha=0.3)
            if series:
                ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, fname), dpi=110)
        plt.close(fig)
    if iso:
        keys = sorted(iso)
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(keys)), 4.5))
        width = 0.8
        labelled = set()
        for i, key in enumerate(keys):
            ms = [iso[key]["ms"][r] for r in sorted(iso[key]["ms"])]
            n = len(ms)
            for r, m in enumerate(ms):
                ax.bar(i - width / 2 + (r + 0.5) * width / n, m, width / n, color=f"C{r}",
                       label=None if r in labelled else f"rank {r}")
                labelled.add(r)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"{k[0]} {_tokens(k[1])}\nCP={k[2]} {k[3]}" for k in keys], fontsize=7)
        ax.set_ylabel("ms per step, rank alone")
        ax.set_title("per-rank work balance")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "balance.png"), dpi=110)
        plt.close(fig)
