"""Command line: ``csattn demo`` (the main job) and friends."""

from __future__ import annotations

import argparse
import signal
import sys

__all__ = ["main", "build_parser", "entry"]


def build_parser() -> argparse.ArgumentParser:
    from .demo import add_demo_args

    parser = argparse.ArgumentParser(prog="csattn", description="DeepSeek-V4 hybrid attention for training")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="the main job on a small default (CPU): attention stack checks, then model training",
        description="1) a W/CSA/HCA attention stack on a packed batch of ragged documents: per-layer statistics, "
        "indexer loss, packed vs per-document difference (and CP=N parity with --cp N); 2) a tiny DeepSeek-V4 "
        "model trained a few steps on packed data at CP=1 and CP=2, loss curves side by side.")
    demo.add_argument("--only", choices=["stack", "model"], default=None, help="run one of the two parts")
    add_demo_args(demo)
    from .train.demo import add_model_demo_args

    add_model_demo_args(demo)
    from .train.cli import add_train_args

    train = sub.add_parser("train", help="train the DeepSeek-V4 model on packed documents (torchrun-compatible)",
                           description="Train DeepSeek-V4 (HF DeepseekV4ForCausalLM layout) on a packed token "
                           "stream: data parallel x context parallel, AdamW, checkpoints, exact resume.")
    add_train_args(train)
    from .report import add_report_args

    report = sub.add_parser("report", help="memory and speed scaling report (GPU): JSON, Markdown, PNG plots",
                            description="Memory and speed scaling of one CSA and one HCA layer (forward + "
                            "backward) over packed tokens, CP sizes, partitions and paths.")
    add_report_args(report)
    from .parallel.plan import add_plan_args

    plan = sub.add_parser("plan", help="per-rank memory and step time of a sharded run (no GPU)",
                          description="Per-rank bytes (parameters, gradients, optimizer state, gathered units, "
                          "kept activations, workspaces, communication buffers), whether it fits an H200, and an "
                          "estimated step time of DeepSeek-V4 on a dp_replicate x dp_shard x cp mesh with ep.")
    add_plan_args(plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo
        from .train.demo import run_model_demo

        only = "model" if args.model else args.only
        rc = 0 if only == "model" else run_demo(args)
        if only != "stack" and rc == 0:
            print()
            rc = run_model_demo(args)
        return rc
    if args.command == "train":
        from .train.cli import run_train

        return run_train(args)
    if args.command == "report":
        from .report import run_report

        return run_report(args)
    if args.command == "plan":
        from .parallel.plan import run_plan

        try:
            return run_plan(args)
        except ValueError as e:
            print(f"csattn plan: error: {e}", file=sys.stderr)
            return 2
    return 2


def entry() -> None:
    """The ``csattn`` program (console script and ``python -m csattn``): :func:`main`, then exit with its status."""
    rc = main()
    if rc:
        # the command said why it failed and chose its exit status; under torchrun, whose agent stops the other
        # ranks with SIGTERM once one rank exits non-zero, each rank still ends with its own status instead of
        # being killed on its way out
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(rc)


if __name__ == "__main__":
    entry()
