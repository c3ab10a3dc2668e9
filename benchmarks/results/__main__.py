"""``python -m benchmarks.results``: render the results page, the README's figures and the planner's measured
constants from the JSON files, or (``--measure``) measure them."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from .measure import run_stages
from .page import render_page
from .planner import MEASURED, write_measured
from .sources import STAGES

ROOT = Path(__file__).resolve().parents[2]


def _commit() -> str:
    """``CSATTN_COMMIT`` (a device's copy of the tree has no git history), else ``git rev-parse``."""
    if os.environ.get("CSATTN_COMMIT"):
        return os.environ["CSATTN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=ROOT).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json-dir", type=Path, default=ROOT / "benchmarks" / "results" / "h200",
                    help="the page's JSON files (default %(default)s)")
    ap.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md", help="the page (default %(default)s)")
    ap.add_argument("--plots-dir", type=Path, default=ROOT / "docs" / "benchmarks", help="the page's plots")
    ap.add_argument("--report-dir", type=Path, default=ROOT / "docs" / "report",
                    help="where the scaling report's parts are merged (report.json, report.md, plots)")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md",
                    help="the README whose figure paragraphs are rewritten with the page (default %(default)s)")
    ap.add_argument("--no-readme", action="store_true", help="write the page only, leave the README as it is")
    ap.add_argument("--measured", type=Path, default=ROOT / MEASURED,
                    help="the planner's measured constants, written first (default %(default)s)")
    ap.add_argument("--measure", action="store_true", help="run the stages on this machine's GPU instead")
    ap.add_argument("--stages", nargs="+", default=[s for s in STAGES if STAGES[s]], choices=list(STAGES),
                    help="with --measure: which stages, in order (default: all)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="with --measure: start no command past this many seconds, clip timeouts to it")
    ap.add_argument("--commit", default=None, help="with --measure: the commit recorded (default: git rev-parse)")
    args = ap.parse_args(argv)
    if args.measure:
        run_stages(args.stages, args.json_dir, args.commit or _commit(), args.budget_s)
        return
    if write_measured(args.json_dir, args.measured):
        # this process imported the planner with its old constants (to derive the new ones); the page's planner
        # figures need the new ones: render in a fresh process, which finds the constants current
        print(f"wrote {args.measured}", flush=True)
        subprocess.run([sys.executable, "-m", "benchmarks.results", *(sys.argv[1:] if argv is None else argv)],
                       cwd=ROOT, check=True)
        return
    readme = None if args.no_readme else args.readme
    render_page(args.json_dir, args.out, args.plots_dir, args.report_dir, readme=readme)
    print(f"wrote {args.out}" + (f" and the figures of {readme}" if readme else ""))


if __name__ == "__main__":
    main()
