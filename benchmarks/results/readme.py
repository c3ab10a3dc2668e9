"""The README's measured figures, written from the same JSON files as the results page.

Each paragraph of ``README.md`` that cites a measurement stands between two marker lines,

    <!-- results:model (written by python -m benchmarks.results) -->
    On the H200 the 4-layer V4-Flash proxy's training step runs at ...
    <!-- /results:model -->

and ``python -m benchmarks.results`` rewrites what is between them with :func:`readme_paragraphs`, so a README figure
is always one the page shows (``tests/test_readme_numbers.py`` checks both). To change such a paragraph's words, edit
its function here and run the command.
"""

from __future__ import annotations

import re
import textwrap

from .data import gib, ms, num, times, tok
from .sections import SOAK, Context, _anchor, _balance, _model_rows, _summary
from .sources import SHARDED

__all__ = ["readme_paragraphs", "fill_readme", "MARKER"]

# the opening line may carry a note after the name; the closing line names the same paragraph
MARKER = re.compile(r"^<!-- results:(?P<name>[\w-]+)(?: [^\n]*)? -->\n(?P<body>.*?)^<!-- /results:(?P=name) -->$",
                    re.S | re.M)
WIDTH = 116  # the README's prose width


class MissingResult(ValueError):
    """A README paragraph needs a measurement the JSON folder does not hold."""


def _need(value, what: str, name: str):
    if value is None or value == {} or value == []:
        raise MissingResult(f"the README's {name!r} figures need {what}: measure it (python -m benchmarks.results "
                            "--measure) or change benchmarks/results/readme.py")
    return value


def _model(ctx: Context, page: str) -> str:
    rows = {(r["shape"]["tokens"], r["shape"].get("recompute", "none")): r for r in _model_rows(ctx.res)
            if r.get("ms") is not None}
    plain = sorted(t for t, rc in rows if rc == "none")
    _need(plain[1:], "model.json with two lengths (recompute none)", "model")
    first, second, longest = rows[(plain[0], "none")], rows[(plain[1], "none")], rows[(plain[-1], "none")]
    offloaded = sorted(t for t, rc in rows if rc == "full+offload")
    _need(offloaded, "model_512k.json (recompute full+offload)", "model")
    offload = rows[(offloaded[-1], "full+offload")]
    train = _need(next((r for r in ctx.res.records(SHARDED) if r.get("ranks") == 1 and r.get("tokens_per_s")
                        and r.get("tokens") == plain[0]), None), f"{SHARDED} (one rank at {tok(plain[0])})", "model")
    hf = {r["provider"]: r for r in ctx.res.records("model_hf.json") if r.get("ms") is not None}
    ours = _need(hf.get("csattn"), "model_hf.json (csattn)", "model")
    base = _need(hf.get("hf"), "model_hf.json (hf)", "model")
    return (f"On the H200 the 4-layer V4-Flash proxy's training step runs at {first['tokens_per_s'] / 1e3:.1f}k "
            f"tokens/s at {tok(plain[0])} tokens ({first['mfu']:.1%} MFU, {second['mfu']:.1%} at {tok(plain[1])}), "
            f"`csattn train` at {train['tokens_per_s']:,.0f} tokens/s ({train['mfu']:.1%} MFU); the step peaks at "
            f"{gib(longest['peak_gib'])} GiB at {tok(plain[-1])} tokens without recompute, and "
            f"{tok(offload['shape']['tokens'])} tokens fit with `--recompute full --offload-block-inputs` "
            f"({offload['tokens_per_s'] / 1e3:.1f}k tokens/s, {gib(offload['peak_gib'])} GiB; block inputs in pinned "
            "host memory; run it with PyTorch's `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`). It is "
            f"{times(base['ms'] / ours['ms'])} faster than HF eager with {times(base['peak_gib'] / ours['peak_gib'])} "
            f"less memory at {tok(ours['shape']['tokens'])} tokens, about the longest HF fits ([BENCHMARKS.md]"
            f"({page}{_anchor('Model step')}), [HF integration]({page}{_anchor('HF integration')})).")


def _kernels(ctx: Context, page: str) -> str:
    def longest(file: str, provider: str = "triton") -> dict:
        recs = [r for r in ctx.res.records(file, variant="", provider=provider)
                if r.get("ms") is not None and r["shape"].get("topk", 512) == 512]
        return _need(max(recs, key=lambda r: r["shape"]["tokens"], default=None), file, "kernels")

    fwd_file, bwd_file, topk_file = "sparse_attn_fwd.json", "sparse_attn_bwd.json", "indexer_topk.json"
    fwd, bwd, topk, peer = longest(fwd_file), longest(bwd_file), longest(topk_file), longest(bwd_file, "cudnn")
    t = fwd["shape"]["tokens"]
    if not bwd["shape"]["tokens"] == topk["shape"]["tokens"] == peer["shape"]["tokens"] == t:
        raise MissingResult(f"the README's 'kernels' figures need {fwd_file}, {bwd_file} (with cudnn) and "
                            f"{topk_file} at one length")
    speed = peer["ms"] / bwd["ms"]
    return (f"On an H200 at {tok(t)} tokens the Gluon sparse-attention forward runs at {num(fwd['tflops'])} TFLOP/s "
            f"({ms(fwd['ms'])} ms) and its backward at {num(bwd['tflops'])} TFLOP/s ({ms(bwd['ms'])} ms, "
            f"{times(speed)} {'faster than' if speed >= 1 else 'as fast as'} cuDNN's); the indexer's scores and exact "
            f"top-k take {ms(topk['ms'])} ms, {'less' if topk['ms'] < fwd['ms'] else 'more'} than the sparse-attention "
            f"forward they feed ([BENCHMARKS.md]({page}{_anchor('Kernels against cuDNN')})).")


def _cp(ctx: Context, page: str) -> str:
    summary = _summary(ctx.report)
    keys = [(k[1], k[3]) for k in summary if k[0] == "csa" and k[2] == "triton" and k[3] > 1 and "ms" in summary[k]]
    tokens, cp = _need(max(keys, default=None, key=lambda k: (k[1], k[0])), "report_cp4.json (CSA, CP > 1)", "cp")
    one = _need(summary.get(("csa", tokens, "triton", 1, "-")), f"report_cp1.json (CSA at {tok(tokens)})", "cp")
    cont = _need(summary.get(("csa", tokens, "triton", cp, "contiguous")), "report_cp4.json (contiguous)", "cp")
    balance = _balance(ctx.report)
    bal, cbal = (_need(balance.get(("csa", tokens, cp, p)), f"report_cp4.json (ranks timed alone, {p})", "cp")
                 for p in ("balanced", "contiguous"))
    return (f"On the H200 one CSA layer at {tok(tokens)} tokens keeps {gib(one['act_gib'])} GiB of activations at "
            f"CP = 1 and {gib(cont['act_gib'])} GiB per rank at CP = {cp} ({times(one['act_gib'] / cont['act_gib'])} "
            f"less), and peaks at {gib(one['peak_gib'])} and {gib(cont['peak_gib'])} GiB; each rank timed alone, the "
            f"slowest takes {num(bal, '.3f')}x the fastest's time with the `balanced` partition and "
            f"{num(cbal, '.3f')}x with the contiguous one ([BENCHMARKS.md]({page}{_anchor('Context parallelism')})).")


def _memory(ctx: Context, page: str) -> str:
    summary = {k: v for k, v in _summary(ctx.report).items() if k[0] == "csa" and k[3] == 1 and "ms" in v}

    def pair(base: str) -> tuple[int, dict, dict]:
        both = [k[1] for k in summary if k[2] == base and ("csa", k[1], "triton", 1, "-") in summary]
        t = _need(max(both, default=None), f"report_cp1.json (CSA, fused and {base})", "memory")
        return t, summary[("csa", t, "triton", 1, "-")], summary[("csa", t, base, 1, "-")]

    t, fused, unfused = pair("unfused")
    th, fused_h, hf = pair("hf")
    return (f"One CSA layer (V4-Flash geometry) at {tok(t)} tokens keeps {gib(fused['act_gib'])} GiB for its "
            f"backward and peaks at {gib(fused['peak_gib'])} GiB for forward + backward on the fused path, against "
            f"{gib(unfused['peak_gib'])} GiB for the same layer on unfused PyTorch autograd; at {tok(th)} tokens it "
            f"is {times(hf['ms'] / fused_h['ms'])} faster than HF eager and needs "
            f"{times(hf['peak_gib'] / fused_h['peak_gib'])} less memory ({gib(fused_h['peak_gib'])} vs "
            f"{gib(hf['peak_gib'])} GiB; [BENCHMARKS.md]({page}{_anchor('Layer')})).")


def _deterministic(ctx: Context, page: str) -> str:
    soak = _need(next(iter(ctx.res.records(SOAK)), None), SOAK, "deterministic")
    killed = soak.get("bitwise_equal_losses", {}).get("killed") and soak.get("bitwise_equal_weights", {}).get("killed")
    kills = {1: "once", 2: "twice"}.get(len(soak.get("kills", [])), f"{len(soak.get('kills', []))} times")
    base = _need(ctx.res.one("model_deterministic_base.json", provider="csattn", variant=""),
                 "model_deterministic_base.json", "deterministic")
    det = _need(ctx.res.one("model_deterministic.json", provider="csattn", variant="deterministic",
                            tokens=base["shape"]["tokens"]), "model_deterministic.json", "deterministic")
    by_t: dict[int, dict[str, dict]] = {}
    for r in ctx.res.records("deterministic_kernels.json", provider="triton"):
        if r.get("ms") is not None:
            by_t.setdefault(r["shape"]["tokens"], {})[r.get("variant", "")] = r
    t = _need(max((t for t, v in by_t.items() if "" in v and "deterministic=1" in v), default=None),
              "deterministic_kernels.json", "deterministic")
    verdict = "ends with" if killed else "does **not** end with"
    return (f"On the H200 a run of the proxy killed {kills} and resumed {verdict} the losses and weights of an "
            f"uninterrupted run, bit for bit; the proxy's training step costs {times(det['ms'] / base['ms'])} and the "
            f"sparse-attention backward {times(by_t[t]['deterministic=1']['ms'] / by_t[t]['']['ms'])} at {tok(t)} "
            f"tokens ([BENCHMARKS.md]({page}{_anchor('Deterministic mode')})).")


def _finetune(ctx: Context, page: str) -> str:
    data = _need(ctx.res.files.get("finetune.json"), "finetune.json", "finetune")
    rows = {(r["mode"], r["tokens"]): r for r in data.get("results", []) if r.get("ms") is not None}

    def run(mode: str, tokens: int) -> dict:
        return _need(rows.get((mode, tokens)), f"mode ({mode}) at {tok(tokens)} tokens", "finetune")

    a, c, a64 = run("a", 16384), run("c", 16384), run("a", 65536)
    moe = _need(data.get("moe"), "the MoE records", "finetune")
    ratio = data.get("expert_bytes", {}).get("ratio", moe.get("expert_bytes_fp8_over_bf16"))
    speedup, target = moe["speedup_over_bf16"]["fp8"], moe.get("target_fp8_speedup", 1.3)
    return (f"On one H200 a real-width slice of V4-Flash (four layers, 256 experts top-6, from a synthetic checkpoint "
            f"in the release's format) trains LoRA over frozen FP8 experts at {a['tokens_per_s']:,.0f} tokens/s at "
            f"{tok(a['tokens'])} tokens ({a['mfu']:.1%} MFU) peaking at {gib(a['peak_gib'])} GiB, against "
            f"{c['tokens_per_s']:,.0f} tokens/s and {gib(c['peak_gib'])} GiB with the experts frozen in bf16"
            f"{_beside_d(a, rows)}, and {a64['tokens_per_s']:,.0f} tokens/s at {tok(a64['tokens'])} "
            f"({gib(a64['peak_gib'])} GiB). The experts "
            f"take {num(ratio, '.3f')} of their bf16 bytes; their FP8 forward + input gradient runs at "
            f"{times(speedup)} the bf16 grouped path's speed{_other_cards(data, speedup, target)} "
            f"([BENCHMARKS.md]({page}{_anchor('Fine-tuning')})).")


def _other_cards(data: dict, speedup: float, target: float) -> str:
    """Where the frozen FP8 MoE's speed-up stands beside its target; with its commit and the speed-ups measured on
    other cards than the page's (``moe_cards``) where there are any."""
    said = [f"{times(m['speedup_over_bf16']['fp8'])} on one {card} at {m.get('commit', '?')}"
            f"{_short_of(m['speedup_over_bf16']['fp8'], target)}"
            for card, m in sorted(data.get("moe_cards", {}).items())]
    if not said:
        return _short_of(speedup, target)
    return f" on the H200 at {data['moe'].get('commit', '?')}{_short_of(speedup, target)}; " + "; ".join(said)


def _beside_d(a: dict, rows: dict) -> str:
    """Mode (a) over (d), everything trained in bf16, at (a)'s length where both ran at one commit (side by side)."""
    d = rows.get(("d", a["tokens"]))
    if d is None or not a.get("commit") or a.get("commit") != d.get("commit"):
        return ""
    ratio = a["tokens_per_s"] / d["tokens_per_s"]
    return f" and {d['tokens_per_s']:,.0f} tokens/s training every weight in bf16 ({times(ratio)} that)"


def _short_of(speedup: float, target: float) -> str:
    """What the README says of the frozen FP8 MoE's speed-up beside its target."""
    if speedup >= target:
        return f" (target {target}x: met)"
    return f", short of the {target}x target" if speedup > 1 else ", not yet faster"


PARAGRAPHS = {"finetune": _finetune, "deterministic": _deterministic, "kernels": _kernels, "cp": _cp, "model": _model,
              "memory": _memory}


def readme_paragraphs(ctx: Context, page_link: str) -> dict[str, str]:
    """Each README figure paragraph (one line, unwrapped) by marker name; ``page_link``: the results page as the
    README links it."""
    return {name: build(ctx, page_link) for name, build in PARAGRAPHS.items()}


def fill_readme(text: str, paragraphs: dict[str, str]) -> str:
    """``text`` (a README) with the body between each pair of markers replaced by its paragraph, wrapped to the
    README's width. Every marker must name a paragraph and every paragraph must have its markers."""
    found = [m["name"] for m in MARKER.finditer(text)]
    unknown = sorted(set(found) - set(paragraphs))
    missing = sorted(set(paragraphs) - set(found))
    if unknown or missing or len(found) != len(set(found)):
        raise ValueError(f"README markers: unknown {unknown}, missing {missing}, found {found}; each of "
                         f"{sorted(paragraphs)} needs one '<!-- results:NAME -->' ... '<!-- /results:NAME -->' pair "
                         "of lines")

    def body(m: re.Match) -> str:
        wrapped = textwrap.fill(paragraphs[m["name"]], WIDTH, break_long_words=False, break_on_hyphens=False)
        head = m.group(0)[: m.start("body") - m.start()]
        return f"{head}{wrapped}\n<!-- /results:{m['name']} -->"

    return MARKER.sub(body, text)
