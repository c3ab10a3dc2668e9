"""The page's "Fine-tuning" section, from ``finetune.json`` (``python -m benchmarks.finetune``): the slice's training
step per mode beside the planner, the frozen-expert MoE alone, the FP8 / weight-only logits, the 2-rank run."""

from __future__ import annotations

from typing import Any

from .data import gib, ms, num, times, tok
from .sections import Claim, Context, Section, _anchor, _provenance, _table

__all__ = ["FINETUNE", "QUALITY", "QUALITY_PLOT", "finetune_section", "quality_lines"]

FINETUNE = "finetune.json"
QUALITY = "finetune_quality.json"  # benchmarks.finetune_quality's quality.json, run by lab/finetune_session.sh
QUALITY_PLOT = "finetune_loss.png"
TITLE = "Fine-tuning"


def _weights(w: dict[str, Any] | None) -> str:
    if not w:
        return "-"
    parts = " + ".join(f"{v:.1f} {k.replace('float8_e4m3fn', 'fp8').replace('bfloat16', 'bf16')}"
                       for k, v in sorted(w["by_dtype"].items(), key=lambda kv: -kv[1]) if v >= 0.05)
    return f"{w['total']:.1f} ({parts})" if parts else f"{w['total']:.2f}"


def _step_rows(records: list[dict]) -> list[list[str]]:
    rows = []
    for r in records:
        head = [f"({r['mode']}) {r['what']}", tok(r["tokens"])]
        if r.get("ms") is None:
            rows.append([*head, r.get("error", "not measured"), "", "", "", gib(r.get("planned_gib")), "", ""])
            continue
        ratio = r.get("planned_over_peak")
        rows.append([*head, ms(r["ms"]), f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.1%}" if r.get("mfu") else "-",
                     gib(r.get("peak_gib")), gib(r.get("planned_gib")), times(ratio) if ratio else "-",
                     _weights(r.get("weights_gib"))])
    return rows


def _moe_table(moe: dict[str, Any]) -> list[str]:
    rows = [[p, ms(r.get("ms")) if r.get("ms") else r.get("error") or r.get("skipped", "-"), num(r.get("tflops")),
             times(moe["speedup_over_bf16"].get(p)) if p != "bf16" else "1.00x" if r.get("ms") else "-"]
            for p, r in ((r["provider"], r) for r in moe.get("records", []))]
    return _table(["path", "ms", "TFLOP/s", "over bf16"], rows)


def _moe_claim(moe: dict[str, Any], ratio: float | None, where: str = "") -> list[Claim]:
    by = {r["provider"]: r for r in moe.get("records", [])}
    fp8, bf16 = by.get("fp8", {}), by.get("bf16", {})
    if not (fp8.get("ms") and bf16.get("ms")):
        return []
    return [Claim(f"frozen-expert MoE fwd + input grad, FP8, 16k tokens, 256 experts top-6{where}",
                  f"{ms(fp8['ms'])} ms", f"bf16 grouped: {ms(bf16['ms'])} ms", bf16["ms"] / fp8["ms"],
                  1 / ratio if ratio else None, _anchor(TITLE))]


def _moe_lines(moe: dict[str, Any], expert_bytes: dict[str, Any] | None,
               cards: dict[str, Any] | None = None) -> tuple[list[str], list[Claim]]:
    """The frozen MoE on the page's card, then on any other card (``moe_cards``: measured on it, by its name)."""
    if not moe or moe.get("error"):
        return ([f"Frozen-expert MoE alone: {moe['error']}"] if moe else []), []
    ratio = (expert_bytes or {}).get("ratio", moe.get("expert_bytes_fp8_over_bf16"))
    lines = ["The routed experts alone (`benchmarks.run --op moe_frozen`): forward + input gradient of frozen experts "
             "(no weight gradient), 256 experts top-6, 16k tokens, D 4096, I 2048, by grouped path; target FP8 >= "
             f"{moe.get('target_fp8_speedup', 1.3)}x bf16. Routed experts' bytes, FP8 (e4m3 + 128x128 scales) over "
             f"bf16: {num(ratio, '.3f')} (target <= {moe.get('target_bytes', 0.52)}).", "", *_moe_table(moe)]
    claims = _moe_claim(moe, ratio)
    for card, other in sorted((cards or {}).items()):
        lines += ["", f"The same on one {card} (commit `{other.get('commit', '?')}`, {other.get('date', '?')}; "
                  "`python -m benchmarks.finetune --ckpt /tmp/none --parts moe`, merged by `python -m "
                  "lab.merge_finetune`):", "", *_moe_table(other)]
        claims += _moe_claim(other, ratio, f", {card}")
    return lines, claims


def _ranks_lines(r: dict[str, Any] | None) -> list[str]:
    if not r:
        return []
    if not any(r.get("peak_gib_per_rank") or []):
        why = f"timed out at its cap (rc {r['rc']})" if r.get("rc") == 124 else r.get("error") or f"rc {r.get('rc')}"
        done = r.get("losses") or []
        ran = (f" after {len(done)} step(s) (loss {done[-1]:.2f}, {r['tokens_per_s']:,.0f} tokens/s through gloo on "
               "one GPU)" if done and r.get("tokens_per_s") else "")
        return ["", f"Mode ({r.get('mode', 'a')}) through `csattn train` on two gloo ranks sharing the GPU "
                f"({r.get('mesh', 'ep 2')}), planned {gib(r.get('planned_gib'))} GiB per rank: {why}{ran}; no "
                "per-rank peak recorded."]
    rows = [[str(i), gib(p), gib(r.get("planned_gib")), times(r["planned_gib"] / p) if p else "-"]
            for i, p in enumerate(r.get("peak_gib_per_rank") or [])]
    return ["", f"Mode ({r.get('mode', 'a')}) through `csattn train` on two gloo ranks sharing the GPU, "
            f"{r.get('mesh')}, {tok(r['tokens_per_rank'])} tokens per rank: each rank's peak beside the planner's.",
            "",
            *_table(["rank", "peak GiB", "planned GiB", "planned / peak"], rows)]


def _one_node_lines() -> list[str]:
    """The planner's one-node pick for V4-Flash LoRA at 64k (pure arithmetic: the same on any machine)."""
    from csattn.parallel.plan import load_config, search, train_command, training_spec

    c = load_config("benchmarks/configs/v4_flash.json")
    p = search(c, 8, 65536, name="v4_flash", training=training_spec(lora_rank=16))
    if p is None:
        return ["", "One node (V4-Flash, 8 x H200, 64k tokens, LoRA rank 16): `csattn plan` finds no plan that fits."]
    d = p.dims
    rows = [[k, gib(v / 2**30)] for k, v in p.memory.terms()] + [["peak (decides the fit)", gib(p.peak / 2**30)]]
    return ["", f"**One node**: `csattn plan --config benchmarks/configs/v4_flash.json --gpus 8 --seq-len 65536 "
            f"--lora-rank 16 --search` (the planner's estimate, not a run: the 8-GPU run needs a multi-GPU machine): "
            f"V4-Flash ({p.params_total / 1e9:.1f} B parameters, {p.params_trained / 1e9:.2f} B trained) fits on "
            f"8 H200s, dp_shard {d['dp_shard']} x cp {d['cp']}, routed experts over ep {d['ep']} (held in FP8, each "
            f"rank its own), recompute {p.recompute}, {p.tokens_per_s / 1e3:.1f}k tokens/s estimated. Per rank "
            "(GiB):", "", *_table(["term", "GiB"], rows), "", "    " + train_command(p)]


def _a_over_d(records: list[dict]) -> list[str]:
    """(a)'s tokens/s over (d)'s at 16k (target 1.35x), when both are timed."""
    by = {(r["mode"], r["tokens"]): r for r in records if r.get("tokens_per_s")}
    a, d = by.get(("a", 16384)), by.get(("d", 16384))
    if not (a and d):
        return []
    both = " (measured side by side)" if a.get("commit") and a.get("commit") == d.get("commit") else ""
    return ["", f"(a) over (d) at 16k: {a['tokens_per_s'] / d['tokens_per_s']:.2f}x the tokens/s{both}; target >= "
            "1.35x. (d) steps with SGD, whose step is a shorter pass over the weights than AdamW's: the ratio is a "
            "lower bound of (a) over an AdamW (d)."]


def quality_lines(ctx: Context) -> list[str]:
    """The LoRA run on real text (``finetune_quality.json``): the loss falls, its plot, where it came from."""
    q = ctx.res.files.get(QUALITY)
    if not isinstance(q, dict) or not q.get("losses"):
        return []
    meta, corpus, losses = q.get("meta", {}), q.get("corpus", {}), q["losses"]
    tenth = max(1, len(losses) // 10)
    text = (f"{q['steps']} LoRA steps on real text with the FP8 base (`--base-precision fp8`), "
            f"{corpus.get('documents')} documents of English prose ({corpus.get('source', '?')}, "
            f"{corpus.get('chars'):,} characters, sha256 `{str(corpus.get('sha256', ''))[:12]}`) through a "
            f"byte-level BPE tokenizer of {q.get('tokenizer_vocab')} tokens trained on them, 2k tokens a step: "
            f"the loss falls from {q['first_mean']:.2f} (mean of the first {tenth} steps) to "
            f"{q['last_mean']:.2f} (the last {tenth}); peak {gib(q.get('peak_gib'))} GiB.")
    where = (f"From [`{QUALITY}`]({ctx.json_link}/{QUALITY}) (commit `{meta.get('commit', '?')}`), "
             f"`{meta.get('driver', 'python -m benchmarks.finetune_quality')}`:")
    return ["", f"**Quality**: {text} {where}", "", f"![loss per step]({ctx.plots_link}/{QUALITY_PLOT})"]


def finetune_section(ctx: Context) -> Section | None:
    data = ctx.res.files.get(FINETUNE)
    if not isinstance(data, dict):
        return None
    meta = data.get("meta", {})
    lines = [f"Fine-tuning a real-geometry slice of V4-Flash (`{meta.get('config', '?')}`: its first four layers, "
             "W / W / CSA / HCA, three hash-routed; full widths, 256 experts top-6) loaded from a synthetic "
             "checkpoint in the release's format (FP8 dense, MXFP4 experts), one GPU. LoRA rank "
             f"{meta.get('lora_rank', 16)} on {', '.join(meta.get('lora_targets', []))}. One step = forward, "
             "backward, AdamW on packed documents (T/4 - 100, T/4 + 100, T/2). MFU counts the FLOPs run "
             "(`csattn.models.deepseek_v4.flops.finetune_flops`: no weight gradient for frozen weights, LoRA's "
             "GEMMs, FP8 GEMMs at the bf16 peak; up to de6a376 LoRA on the projections a layer reads was an "
             "effective weight W + s B A, whose weight gradient ran and is counted in those records). peak = "
             "`max_memory_allocated` during the steps, weights included; planned = `csattn plan`'s peak for the same "
             "run (target: within 10 %); weights GiB by storage dtype.", "",
             *_table(["mode", "tokens", "ms/step", "tokens/s", "MFU", "peak GiB", "planned GiB", "planned / peak",
                      "weights GiB"], _step_rows(data.get("results", [])), right_from=2)]
    lines += _a_over_d(data.get("results", []))
    logits = data.get("logits") or {}
    if logits.get("rel_l2") is not None:
        lines += ["", f"Logits with FP8 compute against the weight-only mode (same weights, {tok(logits['tokens'])} "
                  f"tokens): relative L2 difference {logits['rel_l2']:.2e}, largest element difference "
                  f"{logits['max_abs_over_max']:.2e} of the largest logit."]
    moe_lines, claims = _moe_lines(data.get("moe") or {}, data.get("expert_bytes"), data.get("moe_cards"))
    if moe_lines:
        lines += ["", *moe_lines]
    lines += _ranks_lines(data.get("ranks"))
    lines += quality_lines(ctx)
    lines += _one_node_lines()
    lines += _provenance(ctx, [FINETUNE])
    return Section(TITLE, lines, claims)
