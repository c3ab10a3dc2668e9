"""The page's sections, one function each: a Markdown table from its JSON files, the command and file it comes
from, and the rows it adds to the headline table. A section whose files are missing is left out."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .data import Results, commit_of, gib, ms, num, times, tok
from .planner import KEPT, RECOMPUTE, MissingMeasurement, kept_kib
from .sources import SHARDED, source

__all__ = ["Section", "Claim", "Context", "model_section", "hf_section", "layer_section", "cp_section",
           "kernels_section", "graphs_section", "sharded_section", "deterministic_section", "planner_inputs_section"]

PATHS = {"triton": "csattn (fused)", "unfused": "unfused PyTorch", "reference": "PyTorch reference",
         "hf": "HF eager"}


@dataclass
class Claim:
    """One row of the headline comparison: csattn against a baseline, ratios > 1 in csattn's favour."""

    what: str
    ours: str
    baseline: str
    speed: float | None
    memory: float | None
    anchor: str


@dataclass
class Section:
    title: str
    lines: list[str]
    claims: list[Claim] = field(default_factory=list)

    @property
    def anchor(self) -> str:
        return "#" + "".join(c for c in self.title.lower().replace(" ", "-") if c.isalnum() or c == "-")


@dataclass
class Context:
    """What the sections need beside the data: where the files are, as the page links them."""

    res: Results
    json_link: str  # the JSON folder, relative to the page
    report_link: str  # the merged scaling report's folder, relative to the page
    plots_link: str  # the page's plots folder, relative to the page
    report: list[dict] = field(default_factory=list)  # the merged report's records


def _anchor(title: str) -> str:
    return Section(title, []).anchor


def _table(header: list[str], rows: list[list[str]], right_from: int = 1) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |",
            *("| " + " | ".join(r) + " |" for r in rows)]


def _provenance(ctx: Context, files: list[str]) -> list[str]:
    """Which files (with their commit and date) a table comes from, and the commands that write them."""
    present = [f for f in files if f in ctx.res.files]
    commits: dict[str, None] = {}
    for f in present:  # a file of one record (no "results") has its file's commit
        for r in ctx.res.records(f) or [{"commit": commit_of({}, ctx.res.meta(f))}]:
            commits[r["commit"]] = None
    dates = sorted({str((ctx.res.meta(f) or {}).get("date", ""))[:10] for f in present} - {""})
    when = f"commit {', '.join(f'`{c}`' for c in commits) or '?'}" + (f", {', '.join(dates)}" if dates else "")
    links = ", ".join(f"[`{f}`]({ctx.json_link}/{f})" for f in present)
    return ["", f"From {links} ({when}):", "", *(f"    {source(f).command()}" for f in present)]


def _model_rows(res: Results) -> list[dict]:
    rows = [r for f in ("model.json", "model_128k.json", "model_512k.json") for r in res.records(f, provider="csattn")]
    return sorted(rows, key=lambda r: (r["shape"]["tokens"], str(r["shape"].get("recompute"))))


def _first_step(r: dict) -> bool:
    """Timed from one step only, kernel compilation included."""
    return len(r.get("info", {}).get("steps_ms", [])) == 1


def model_headline(res: Results) -> list[str]:
    """The proxy's training step at each measured length: the page's first table."""
    rows = []
    for r in _model_rows(res):
        t, rc = r["shape"]["tokens"], r["shape"].get("recompute", "none")
        if r.get("ms") is None:
            rows.append([tok(t), rc, r.get("error", "not measured"), "", ""])
            continue
        first = " (first step)" if _first_step(r) else ""
        rows.append([tok(t), rc, f"{r['tokens_per_s'] / 1e3:.1f}k{first}", f"{r['mfu']:.1%}" if r.get("mfu") else "-",
                     gib(r.get("peak_gib"))])
    return _table(["tokens", "recompute", "tokens/s", "MFU", "GiB"], rows, right_from=2) if rows else []


def model_section(ctx: Context) -> Section | None:
    recs = _model_rows(ctx.res)
    if not recs:
        return None
    rows = []
    for r in recs:
        rows.append([tok(r["shape"]["tokens"]), r["shape"].get("recompute", "none"),
                     ms(r.get("ms")) + (" (first step)" if _first_step(r) else ""),
                     f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else r.get("error", "-"),
                     num(r.get("tflops")), f"{r['mfu']:.1%}" if r.get("mfu") else "-", gib(r.get("peak_gib"))])
    lines = ["One training step (forward + backward, loss without `[T, V]` logits) of `DeepseekV4ForCausalLM` on "
             "`benchmarks/configs/v4_flash_proxy.json`: hidden 4096, 64 heads of 512, layers W / CSA / HCA / CSA, "
             "8 experts top-2, hc_mult 4, 1.64 B parameters, bf16; documents of T/4 - 100, T/4 + 100 and T/2 "
             "tokens. GiB = peak allocated during the step beyond the weights. `full+offload`: every block "
             "recomputed, its inputs kept in host memory.", "",
             *_table(["tokens", "recompute", "ms/step", "tokens/s", "TFLOP/s", "MFU", "GiB"], rows, right_from=2),
             "", f"![model step time and memory against tokens]({ctx.plots_link}/model_step.png)",
             *_provenance(ctx, ["model.json", "model_128k.json", "model_512k.json"])]
    return Section("Model step", lines)


def hf_section(ctx: Context) -> Section | None:
    recs = {r["provider"]: r for r in ctx.res.records("model_hf.json")}
    if not recs:
        return None
    hf = recs.get("hf") or {}
    names = {"csattn": "csattn `DeepseekV4ForCausalLM`", "hf_patched": "HF model + `csattn.integrations."
             "transformers.patch`", "hf": "HF eager"}
    rows, claims = [], []
    for p in ("csattn", "hf_patched", "hf"):
        r = recs.get(p)
        if r is None:
            continue
        if r.get("ms") is None:
            rows.append([names[p], tok(r["shape"]["tokens"]), r.get("error") or r.get("skipped", "-"), "", "", "", ""])
            continue
        speed = hf["ms"] / r["ms"] if hf.get("ms") and p != "hf" else None
        memory = hf["peak_gib"] / r["peak_gib"] if hf.get("peak_gib") and r.get("peak_gib") and p != "hf" else None
        rows.append([names[p], tok(r["shape"]["tokens"]), ms(r["ms"]), f"{r['tokens_per_s']:,.0f}",
                     gib(r.get("peak_gib")), times(speed), times(memory)])
        if p != "hf" and speed:
            claims.append(Claim(f"{'model step' if p == 'csattn' else 'HF model patched onto csattn'}, "
                                f"{tok(r['shape']['tokens'])} tokens", f"{ms(r['ms'])} ms, {gib(r['peak_gib'])} GiB",
                                f"HF eager: {ms(hf['ms'])} ms, {gib(hf['peak_gib'])} GiB", speed, memory,
                                _anchor("HF integration")))
    lines = ["The same proxy, weights and tokens in Hugging Face `transformers` (`DeepseekV4ForCausalLM`, eager "
             "attention and experts, HF's fp32 modules kept in fp32) on one document, as HF cannot pack; the "
             "patched HF model runs csattn's attention, mHC and MoE ops under HF's modules, head and loss. The "
             "length is about the longest HF eager fits in the H200's memory.", "",
             *_table(["model", "tokens", "ms/step", "tokens/s", "GiB", "faster than HF", "less memory than HF"],
                     rows), *_provenance(ctx, ["model_hf.json"])]
    return Section("HF integration", lines, claims)


def _summary(report: list[dict]) -> dict[tuple, dict]:
    """(layer, tokens, path, cp, partition) -> max over ranks of ms, peak and activation GiB."""
    from csattn.report.render import summarize

    return summarize(report)


def layer_section(ctx: Context) -> Section | None:
    summary = {k: v for k, v in _summary(ctx.report).items() if k[3] == 1 and "ms" in v}
    if not summary:
        return None
    rows, claims = [], []
    order = list(PATHS)
    for key in sorted(summary, key=lambda k: (k[0], k[1], order.index(k[2]) if k[2] in order else 9)):
        layer, tokens, path = key[:3]
        s, fused = summary[key], summary.get((layer, tokens, "triton", 1, "-"), {})
        speed = s["ms"] / fused["ms"] if fused.get("ms") and path != "triton" else None
        memory = s["peak_gib"] / fused["peak_gib"] if fused.get("peak_gib") and path != "triton" else None
        rows.append([layer.upper(), tok(tokens), PATHS.get(path, path), ms(s["ms"]), num(s.get("tflops")),
                     gib(s.get("peak_gib")), gib(s.get("act_gib")), times(speed), times(memory)])
    for layer in sorted({k[0] for k in summary}):
        for base in ("unfused", "hf"):
            both = [k[1] for k in summary if k[0] == layer and k[2] == base and (layer, k[1], "triton", 1, "-")
                    in summary]
            if not both:
                continue
            t = max(both)
            f, b = summary[(layer, t, "triton", 1, "-")], summary[(layer, t, base, 1, "-")]
            claims.append(Claim(f"{layer.upper()} layer fwd + bwd, {tok(t)} tokens",
                                f"{ms(f['ms'])} ms, {gib(f['peak_gib'])} GiB",
                                f"{PATHS[base]}: {ms(b['ms'])} ms, {gib(b['peak_gib'])} GiB", b["ms"] / f["ms"],
                                b["peak_gib"] / f["peak_gib"] if f.get("peak_gib") else None, _anchor("Layer")))
    lines = ["One attention layer with the V4-Flash geometry (D 4096, 64 heads of 512, q_lora 1024, 8 output "
             "groups, W 128; CSA: ratio 4, indexer 64 x 128, top-512, indexer loss on; HCA: ratio 128), bf16, "
             "forward + backward on a ragged packed batch (`csattn report`, median of 2 steps after a warm-up). "
             "Unfused PyTorch = the reference ops under plain autograd, every `[T, H, d]` tensor kept; HF eager = "
             "`DeepseekV4Attention` with its dense mask, one document at a time. peak = allocated during a step; "
             "act. = what the forward keeps for the backward. The last two columns: how much faster and leaner the "
             "fused path is.", "",
             *_table(["layer", "tokens", "path", "ms/step", "TFLOP/s", "peak GiB", "act. GiB", "fused faster",
                      "fused less peak"], rows, right_from=3),
             "", f"![layer time against tokens]({ctx.report_link}/time.png)",
             f"![layer peak memory against tokens]({ctx.report_link}/memory.png)",
             *_report_provenance(ctx)]
    return Section("Layer", lines, claims)


def _report_provenance(ctx: Context) -> list[str]:
    from .sources import REPORT_PARTS

    return [*_provenance(ctx, list(REPORT_PARTS)), "",
            f"merged into [`{ctx.report_link}/`]({ctx.report_link}/report.md) (every row, plots) by this page's "
            "command."]


def _balance(report: list[dict]) -> dict[tuple, float]:
    """(layer, tokens, cp, partition) -> max / min per-rank time, each rank timed alone."""
    ms_by: dict[tuple, list[float]] = defaultdict(list)
    for r in report:
        if r.get("kind") == "isolated" and r.get("ms"):
            ms_by[(r["layer"], r["tokens"], r["cp"], r["partition"])].append(r["ms"])
    return {k: max(v) / min(v) for k, v in ms_by.items() if len(v) > 1}


def cp_section(ctx: Context) -> Section | None:
    summary = _summary(ctx.report)
    keys = sorted({(k[0], k[1], k[3]) for k in summary if k[2] == "triton" and k[3] > 1 and "ms" in summary[k]})
    if not keys:
        return None
    rows, claims = [], []
    balance = _balance(ctx.report)
    for layer, tokens, cp in keys:
        one = summary.get((layer, tokens, "triton", 1, "-"), {})
        parts = {p: summary.get((layer, tokens, "triton", cp, p), {}) for p in ("contiguous", "balanced")}
        cont = parts["contiguous"]
        act = one.get("act_gib") / cont["act_gib"] if one.get("act_gib") and cont.get("act_gib") else None
        rows.append([layer.upper(), tok(tokens), str(cp), gib(one.get("peak_gib")), gib(one.get("act_gib")),
                     " / ".join(gib(parts[p].get("peak_gib")) for p in parts),
                     " / ".join(gib(parts[p].get("act_gib")) for p in parts), times(act),
                     " / ".join(num(balance.get((layer, tokens, cp, p)), ".3f") for p in parts)])
        largest = max((c, t) for ly, t, c in keys if ly == layer)  # the headline: the largest CP, its longest stream
        if act and (cp, tokens) == largest:
            claims.append(Claim(f"{layer.upper()} layer, {tok(tokens)} tokens, CP = {cp}, per rank",
                                f"{gib(cont['act_gib'])} GiB kept, {gib(cont.get('peak_gib'))} GiB peak",
                                f"CP = 1: {gib(one['act_gib'])} GiB kept, {gib(one.get('peak_gib'))} GiB peak", None,
                                act, _anchor("Context parallelism")))
    lines = ["The same layer split over CP ranks (ranks as gloo processes sharing the one GPU, so step times are "
             "not CP speed-ups); memory per rank, the largest rank. Two partitions of the documents over the ranks: "
             "contiguous / balanced. Balance = max / min step time over the ranks, each rank timed alone.", "",
             *_table(["layer", "tokens", "CP", "CP=1 peak GiB", "CP=1 act. GiB", "peak GiB/rank", "act. GiB/rank",
                      "CP=1 / CP act.", "balance"], rows, right_from=3),
             "", f"![kept memory per rank against tokens]({ctx.report_link}/activations.png)",
             f"![per-rank balance]({ctx.report_link}/balance.png)", *_report_provenance(ctx)]
    return Section("Context parallelism", lines, claims)


KERNELS = (("sparse_attn_bwd.json", "sparse attention backward"), ("indexer_topk.json", "indexer scores + top-k"),
           ("sparse_attn_fwd.json", "sparse attention forward"))


def kernels_section(ctx: Context) -> Section | None:
    rows, claims = [], []
    for file, name in KERNELS:
        by_t: dict[int, dict[str, dict]] = defaultdict(dict)
        for r in ctx.res.records(file, variant=""):
            if r.get("shape", {}).get("topk", 512) == 512 and r.get("ms") is not None:
                by_t[r["shape"]["tokens"]][r["provider"]] = r
        for t, p in sorted(by_t.items()):
            ours, peer = p.get("triton"), p.get("cudnn")
            if ours is None:
                continue
            speed = peer["ms"] / ours["ms"] if peer else None
            memory = peer["peak_gib"] / ours["peak_gib"] if peer and peer.get("peak_gib") and ours.get("peak_gib") \
                else None
            rows.append([name, tok(t), ms(ours["ms"]), num(ours.get("tflops")), gib(ours.get("peak_gib")),
                         ms(peer["ms"]) if peer else "no SM90 kernel", gib(peer.get("peak_gib")) if peer else "",
                         times(speed)])
            if peer and t == max(by_t):
                claims.append(Claim(f"{name}, {tok(t)} tokens", f"{ms(ours['ms'])} ms, {gib(ours.get('peak_gib'))} GiB",
                                    f"cuDNN: {ms(peer['ms'])} ms, {gib(peer.get('peak_gib'))} GiB", speed, memory,
                                    _anchor("Kernels against cuDNN")))
    if not rows:
        return None
    lines = ["csattn's Triton / Gluon kernels beside NVIDIA cuDNN Frontend's DeepSeek sparse-attention kernels "
             "(`cudnn.deepseek_sparse_attention`, CuTe-DSL) on the same inputs: H 64, d 512, top-512 + window 128, "
             "ratio 4, one document, bf16; median of `triton.testing.do_bench`. cuDNN has no SM90 sparse forward. "
             "GiB = allocated during one call.", "",
             *_table(["kernel", "tokens", "csattn ms", "TFLOP/s", "GiB", "cuDNN ms", "cuDNN GiB", "faster than cuDNN"],
                     rows, right_from=1), *_provenance(ctx, [f for f, _ in KERNELS])]
    return Section("Kernels against cuDNN", lines, claims)


def graphs_section(ctx: Context) -> Section | None:
    by_t: dict[int, dict[str, dict]] = defaultdict(dict)
    for r in ctx.res.records("layer_step.json"):
        if r.get("ms") is not None:
            by_t[r["shape"]["tokens"]][r["provider"]] = r
    if not by_t:
        return None
    rows, claims = [], []
    for t, p in sorted(by_t.items()):
        eager, graph = p.get("eager", {}).get("ms"), p.get("graph", {}).get("ms")
        speed = eager / graph if eager and graph else None
        rows.append([tok(t), ms(eager), ms(p.get("capture_safe", {}).get("ms")), ms(graph), times(speed)])
        if speed and t == min(by_t):
            claims.append(Claim(f"CSA layer step in a CUDA graph, {tok(t)} tokens", f"{ms(graph)} ms",
                                f"eager: {ms(eager)} ms", speed, None, _anchor("CUDA-graph step")))
    lines = ["One CSA layer's training step (forward + backward with a fixed output gradient): the default eager "
             "path, the capture-safe path run eagerly, and that step captured once in a CUDA graph "
             "(`csattn.capture_safe.CapturedLayerStep`) and replayed with new `cu_seqlens`.", "",
             *_table(["tokens", "eager ms", "capture-safe eager ms", "graph replay ms", "replay faster"], rows),
             *_provenance(ctx, ["layer_step.json"])]
    return Section("CUDA-graph step", lines, claims)


def sharded_section(ctx: Context) -> Section | None:
    data = ctx.res.files.get(SHARDED)
    if not data:
        return None
    meta = data.get("meta", {})
    rows = []
    for r in data.get("results", []):
        planned, peak = r.get("planned_gib"), r.get("peak_gib")
        rows.append([str(r.get("mesh", "-")), str(r.get("ranks", "-")),
                     f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else r.get("error", "-"),
                     f"{r['mfu']:.1%}" if r.get("mfu") else "-", gib(peak), gib(planned),
                     times(planned / peak) if planned and peak else "-"])
    lines = [f"Training the proxy sharded over several GPUs ({meta.get('device', '?')}, commit "
             f"`{meta.get('commit', '?')}`): the mesh, the measured throughput and per-rank peak, and the planner's "
             "per-rank prediction made before launch.", "",
             *_table(["mesh", "ranks", "tokens/s", "MFU", "peak GiB/rank", "planned GiB/rank", "planned / peak"],
                     rows), "", f"From [`{SHARDED}`]({ctx.json_link}/{SHARDED}) (commit `{meta.get('commit', '?')}`):",
             "", f"    {source(SHARDED).command()}"]
    return Section("Sharded training", lines)


DETERMINISTIC = (("deterministic_kernels.json", "sparse-attention backward"),
                 ("deterministic_indexer_loss.json", "indexer-loss backward"))


def deterministic_section(ctx: Context) -> Section | None:
    rows = []
    for file, name in DETERMINISTIC:
        by_t: dict[int, dict[str, dict]] = defaultdict(dict)
        for r in ctx.res.records(file, provider="triton"):
            if r.get("ms") is not None:
                by_t[r["shape"]["tokens"]][r.get("variant", "")] = r
        for t, v in sorted(by_t.items()):
            base = v.get("")
            for variant, label in (("deterministic=1", name), ("deterministic=1,bwd_gluon=0", f"{name}, Triton pair")):
                det = v.get(variant)
                if base and det:
                    rows.append([label, tok(t), ms(base["ms"]), ms(det["ms"]), times(det["ms"] / base["ms"])])
    base = ctx.res.one("model_deterministic_base.json", provider="csattn", variant="", tokens=16384)
    det = ctx.res.one("model_deterministic.json", provider="csattn", variant="deterministic", tokens=16384)
    if base and det:
        rows.append(["proxy training step", tok(16384), ms(base["ms"]), ms(det["ms"]), times(det["ms"] / base["ms"])])
    soak = next(iter(ctx.res.records(SOAK)), None)
    if not rows and soak is None:
        return None
    lines = ["`deterministic=True` (`csattn train --deterministic`, `csattn.deterministic_mode()`): the key gradients "
             "of the sparse attention and the indexer loss summed in exact int64 fixed point (the same bits in any "
             "order), and torch's deterministic mode for the proxy step. Time with it over time without "
             "(the cost); bf16, H200. Both sparse-attention backwards run the Gluon kernel (deterministic mode its "
             "fixed-point variant); the Triton pair's row is the portable path (`bwd_gluon=0`, other GPUs and "
             "shapes) in fixed point.", "",
             *_table(["step", "tokens", "default ms", "deterministic ms", "cost"], rows),
             *_provenance(ctx, [f for f, _ in DETERMINISTIC] + ["model_deterministic.json",
                                                                "model_deterministic_base.json"])]
    if soak is not None:
        lines += ["", *_soak_lines(soak), *_provenance(ctx, [SOAK])]
    return Section("Deterministic mode", lines)


SOAK = "soak_deterministic.json"


def _soak_lines(r: dict) -> list[str]:
    """The soak's verdict: a killed and resumed ``csattn train --deterministic`` against uninterrupted runs."""
    def yes(flags: dict, name: str) -> str:
        return "yes" if flags.get(name) else "**no**"

    kills = " and ".join(str(k["last_step_logged"]) for k in r.get("kills", []))
    losses, weights = r.get("bitwise_equal_losses", {}), r.get("bitwise_equal_weights", {})
    peak = r.get("peak_gib_min_max_after_step_3") or [None, None]
    return [f"Soak (`benchmarks.soak`): {r['steps']} steps of `csattn train --deterministic` on the proxy, three runs "
            f"side by side on the one GPU ({num(r['wall_s'], '.0f')} s of wall time): one killed with SIGKILL after "
            f"steps {kills or '-'} and resumed by `--resume auto` each time, and two uninterrupted. Loss "
            f"{num(r['loss_first_last'][0], '.2f')} -> {num(r['loss_first_last'][1], '.2f')}; allocator peak "
            f"{gib(peak[0])} to {gib(peak[1])} GiB per step after step 3.", "",
            *_table(["run against the uninterrupted one", "losses bitwise equal (every step)",
                     "final weights bitwise equal"],
                    [["killed twice and resumed", yes(losses, "killed"), yes(weights, "killed")],
                     ["a second uninterrupted run", yes(losses, "again"), yes(weights, "again")]])]


def planner_inputs_section(ctx: Context) -> Section | None:
    """The proxy's step under each recompute and what its forward keeps, the planner's measured inputs."""
    steps = [r for r in ctx.res.records(RECOMPUTE, op="model", provider="csattn") if r.get("ms")]
    none = {r["commit"]: r["ms"] for r in steps if r["shape"].get("recompute") == "none"}
    try:
        kept = kept_kib(ctx.res)[0]
    except MissingMeasurement:
        kept = {}
    if not steps and not kept:
        return None
    lines = ["What `csattn plan` reads beside the proxy's MFU (`csattn/parallel/plan/measured.py`, written from these "
             "files): the 4-layer proxy's step at 16k tokens under each recompute, over the step without recompute at "
             "the same commit, and what its forward keeps for the backward, KiB per token per layer by component."]
    if steps:
        rows = [[str(r["shape"]["recompute"]), f"`{r['commit']}`", tok(r["shape"]["tokens"]), ms(r["ms"]),
                 times(r["ms"] / none[r["commit"]] if r["commit"] in none else None), gib(r.get("peak_gib"))]
                for r in steps]
        lines += ["", *_table(["recompute", "commit", "tokens", "ms", "over none", "peak GiB"], rows, right_from=2)]
    if kept:
        lines += ["", *_table(["kept for the backward", "KiB per token per layer (embed, head: per model)"],
                              [[k, num(v, ".2f")] for k, v in kept.items()])]
    return Section("Planner inputs", [*lines, *_provenance(ctx, [RECOMPUTE, KEPT])])
