"""Markdown tables and matplotlib plots of the scaling report."""

from __future__ import annotations

import os
from collections import defaultdict

from ..models.deepseek_v4.flops import PEAK_FLOPS

__all__ = ["render_report", "summarize"]


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


def summarize(records: list[dict]) -> dict:
    """Max over ranks of peak memory and step time per (layer, tokens, path, cp, partition)."""
    out: dict[tuple, dict] = defaultdict(dict)
    for r in records:
        if r.get("kind") != "group":
            continue
        key = (r["layer"], r["tokens"], r["path"], r["cp"], r["partition"] if r["cp"] > 1 else "-")
        cur = out[key]
        if "commit" in r:
            cur["commit"] = r["commit"]
        if "error" in r:
            cur["error"] = r["error"]
            continue
        cur["ms"] = max(cur.get("ms", 0.0), r["ms"])
        for metric in ("peak_gib", "act_gib"):
            if r.get(metric) is not None:
                cur[metric] = max(cur.get(metric, 0.0), r[metric])
        cur["tflops"] = r["flops_fwdbwd"] / cur["ms"] / 1e9
    return dict(out)


def render_report(meta: dict, records: list[dict], out_dir: str) -> str:
    """Write ``report.md`` and PNG plots into ``out_dir``; return the Markdown."""
    summary = summarize(records)
    # a merged report names each row's commit when its rows come from several
    by_commit = len({s.get("commit") for s in summary.values()} - {None}) > 1
    lines = [
        f"Device: {meta['device']}, dtype {meta['dtype']}, geometry {meta['geometry']}, commit {meta['commit']}, "
        f"{meta['date']}; median of {meta['steps']} steps after one warm-up; one layer forward + backward on a "
        "ragged packed batch; peak = per-rank peak allocated during a step above what was allocated before "
        "it (activations, gradients, workspaces), max over ranks; act. = per-rank memory the forward keeps for "
        "the backward (allocated after the forward minus before it, the output included), max over ranks.",
        "",
        "| layer | tokens | path | CP | partition | peak GiB/rank | CP1/CPn peak | act. GiB/rank | CP1/CPn act. "
        "| ms/step | TFLOP/s |" + (" commit |" if by_commit else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if by_commit else ""),
    ]
    for key in sorted(summary, key=lambda k: (k[0], k[2], k[1], k[3], k[4])):
        layer, tokens, path, cp, part = key
        s = summary[key]
        commit = f" {s.get('commit', '-')} |" if by_commit else ""
        if "error" in s and "ms" not in s:
            lines.append(f"| {layer} | {tokens} | {path} | {cp} | {part} | {s['error']} | | | | | |{commit}")
            continue
        base = summary.get((layer, tokens, path, 1, "-"), {})
        ratios = [base.get(m) / s[m] if base.get(m) and s.get(m) and cp > 1 else None
                  for m in ("peak_gib", "act_gib")]
        lines.append(f"| {layer} | {tokens} | {path} | {cp} | {part} | {_fmt(s.get('peak_gib'))} | "
                     f"{_fmt(ratios[0]) if cp > 1 else ''} | {_fmt(s.get('act_gib'))} | "
                     f"{_fmt(ratios[1]) if cp > 1 else ''} | {_fmt(s.get('ms'), '.1f')} | "
                     f"{_fmt(s.get('tflops'), '.1f')} |{commit}")
    iso = _isolated(records)
    lines += headline(summary, iso)
    lines += _model_rows(records, by_commit)
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


def _model_rows(records: list[dict], by_commit: bool) -> list[str]:
    """The model-step table: one training step of the DeepSeek-V4 proxy, csattn and HF eager."""
    rows = sorted((r for r in records if r.get("kind") == "model"), key=lambda r: (r["layer"], r["tokens"], r["path"]))
    if not rows:
        return []
    out = ["", "Model step (forward + backward) of the 4-layer DeepSeek-V4 proxy (csattn.report.model): csattn on "
           "ragged documents T/4 - 100, T/4 + 100, T/2; HF eager on one document (it cannot pack). TFLOP/s = "
           f"csattn.report.model_flops per step time; MFU against {PEAK_FLOPS / 1e12:.0f} TFLOP/s (the H200's dense "
           "bf16 rate); peak = "
           "allocated during the steps beyond the weights.", "",
           "| model | tokens | path | ms/step | tokens/s | TFLOP/s | MFU | peak GiB |"
           + (" commit |" if by_commit else ""),
           "|---|---|---|---|---|---|---|---|" + ("---|" if by_commit else "")]
    for r in rows:
        commit = f" {r.get('commit', '-')} |" if by_commit else ""
        if "error" in r:
            out.append(f"| {r['layer']} | {r['tokens']} | {r['path']} | {r['error']} | | | | |{commit}")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        out.append(f"| {r['layer']} | {r['tokens']} | {r['path']} | {_fmt(r['ms'], '.1f')} | "
                   f"{r['tokens_per_s']:.0f} | {_fmt(r['tflops'], '.1f')} | {mfu} | {_fmt(r.get('peak_gib'))} |"
                   f"{commit}")
    return out


def _ratio(a, b):
    return a / b if a and b else None


def headline(summary: dict, iso: dict) -> list[str]:
    """The figures users size their runs by, read off the table: CP memory scaling (at 32k, 128k and the longest
    length), the fused path against the PyTorch paths, the longest stream each path and CP size ran, and the
    balanced partition's per-rank time spread at the longest isolated length."""
    out = []
    for layer in sorted({k[0] for k in summary}):
        cp_tokens = sorted({k[1] for k in summary if k[0] == layer and k[2] == "triton" and k[3] > 1})
        for tokens in [t for t in cp_tokens if t in (32768, 131072) or t == cp_tokens[-1]]:
            base = summary.get((layer, tokens, "triton", 1, "-"), {})
            parts = []
            for (ly, t, path, cp, part), s in sorted(summary.items()):
                if (ly, t, path) != (layer, tokens, "triton") or cp == 1:
                    continue
                vals = [(_ratio(base.get(m), s.get(m)), name)
                        for m, name in (("act_gib", "act."), ("peak_gib", "peak"))]
                if any(v for v, _ in vals):
                    parts.append(f"CP={cp} {part} " + " / ".join(f"{v:.2f}x {name}" for v, name in vals if v))
            if parts:
                out.append(f"- {layer.upper()} {_tokens(tokens)}, CP1/CPn per rank: " + "; ".join(parts))
        ref_tokens = [k[1] for k in summary if k[0] == layer and k[2] in ("reference", "unfused") and k[3] == 1
                      and "ms" in summary[k]]
        fused = summary.get((layer, max(ref_tokens, default=0), "triton", 1, "-"), {})
        if ref_tokens and fused.get("peak_gib"):
            parts = []
            for path in ("reference", "unfused"):
                s = summary.get((layer, max(ref_tokens), path, 1, "-"), {})
                if s.get("peak_gib"):
                    text = f"{path} {s['peak_gib']:.2f} GiB peak ({s['peak_gib'] / fused['peak_gib']:.2f}x)"
                    if s.get("act_gib") and fused.get("act_gib"):
                        text += f", {s['act_gib']:.2f} GiB act. ({s['act_gib'] / fused['act_gib']:.2f}x)"
                    parts.append(text)
            out.append(f"- {layer.upper()} {_tokens(max(ref_tokens))} CP=1, fused path {fused['peak_gib']:.2f} GiB "
                       f"peak, {_fmt(fused.get('act_gib'))} GiB act.; " + "; ".join(parts))
        for path in ("triton", "reference", "unfused"):
            for cp in sorted({k[3] for k in summary if k[0] == layer and k[2] == path}):
                cases = {k[1]: s for k, s in summary.items() if (k[0], k[2], k[3]) == (layer, path, cp)}
                ok = [t for t, s in cases.items() if "ms" in s]
                failed = sorted(t for t, s in cases.items() if "ms" not in s)
                if ok:
                    s = cases[max(ok)]
                    out.append(f"- {layer.upper()} {path}, CP={cp}: longest stream run {_tokens(max(ok))} tokens, "
                               f"{_fmt(s.get('peak_gib'))} GiB peak per rank, {s['ms']:.0f} ms/step"
                               + (f"; {_tokens(failed[0])}: {cases[failed[0]]['error']}" if failed else ""))
    for (layer, tokens, cp, part), v in sorted(iso.items()):
        ms = list(v["ms"].values())
        if part == "balanced" and tokens == max(k[1] for k in iso if k[0] == layer) and len(ms) > 1:
            out.append(f"- {layer.upper()} {_tokens(tokens)} CP={cp} balanced partition: per-rank time max/min "
                       f"{max(ms) / min(ms):.3f}")
    return ["", "Headline figures:", ""] + out if out else []


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
