"""Command line: ``csattn demo`` (the main job) and friends."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from .demo import add_demo_args

    parser = argparse.ArgumentParser(prog="csattn", description="DeepSeek-V4 hybrid attention for training")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a small W/CSA/HCA stack on a packed batch (CPU)")
    add_demo_args(demo)
    from .report import add_report_args

    report = sub.add_parser("report", help="memory and speed scaling report (GPU): JSON, Markdown, PNG plots",
                            description="Memory and speed scaling of one CSA and one HCA layer (forward + "
                            "backward) over packed tokens, CP sizes, partitions and paths.")
    add_report_args(report)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args)
    if args.command == "report":
        from .report import run_report

        return run_report(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
