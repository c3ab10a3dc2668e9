"""Merge a device call's ``benchmarks.finetune`` JSON into the page's records (``benchmarks/results/h200/
finetune.json``): each measured step record replaces the one of the same (mode, tokens), stamped with its commit; the
frozen-expert MoE part and the expert bytes replace the page's when every path of it was measured (a MoE part from
another card than the page's goes beside it, under ``moe_cards``, by the card's name). A record that
failed, was skipped or holds no time is left out (the page keeps what it has). Then render the page:
``python -m benchmarks.results --out BENCHMARKS.md``.

    python -m lab.merge_finetune OUT/finetune_steps.json OUT/finetune_moe.json [--into PAGE_JSON] [--dry-run]"""

from __future__ import annotations

import argparse
import json
from typing import Any

PAGE = "benchmarks/results/h200/finetune.json"


def merge(page: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``new``'s complete parts into ``page`` (in place). Returns a line per change."""
    commit = new.get("meta", {}).get("commit")
    said = []
    keep = {(r["mode"], r["tokens"]): i for i, r in enumerate(page.get("results", []))}
    for rec in new.get("results", []):
        if rec.get("ms") is None or rec.get("error") or rec.get("skipped"):
            said.append(f"left out ({rec.get('mode')}) {rec.get('tokens')}: {rec.get('error') or 'not measured'}")
            continue
        rec = {**rec, "commit": rec.get("commit") or commit}
        key = (rec["mode"], rec["tokens"])
        old = page["results"][keep[key]] if key in keep else None
        if old is None:
            page.setdefault("results", []).append(rec)
            keep[key] = len(page["results"]) - 1
        else:
            page["results"][keep[key]] = rec
        was = f"{old['ms']:.1f} ms at {old.get('commit')}" if old and old.get("ms") else "none"
        said.append(f"({key[0]}) {key[1]}: {rec['ms']:.1f} ms at {rec['commit']} (was {was})")
    moe = new.get("moe")
    card, page_card = new.get("meta", {}).get("device"), page.get("meta", {}).get("device")
    if moe and not moe.get("error") and moe.get("records") and all(r.get("ms") for r in moe["records"]):
        at = moe.get("commit") or commit  # on each record too: the page's readers take a record's own commit
        rec = {**moe, "commit": at, "records": [{**r, "commit": r.get("commit") or at} for r in moe["records"]]}
        other = bool(card and page_card and card != page_card)  # another card's: beside the page's, never over it
        if other:
            page.setdefault("moe_cards", {})[card] = {**rec, "date": new["meta"].get("date")}
        else:
            page["moe"] = rec
            if new.get("expert_bytes"):
                page["expert_bytes"] = new["expert_bytes"]
        said.append(f"moe: fp8 over bf16 {moe.get('speedup_over_bf16', {}).get('fp8')} at {at}"
                    + (f" on {card}" if other else ""))
    elif moe:
        said.append("moe: left out (a path not measured)")
    return said


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("new", nargs="+", help="benchmarks.finetune JSON files of a device call")
    ap.add_argument("--into", default=PAGE)
    ap.add_argument("--dry-run", action="store_true", help="say what would change, write nothing")
    args = ap.parse_args(argv)
    with open(args.into) as f:
        page = json.load(f)
    for path in args.new:
        with open(path) as f:
            for line in merge(page, json.load(f)):
                print(f"{path}: {line}")
    if not args.dry_run:
        with open(args.into, "w") as f:
            json.dump(page, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
