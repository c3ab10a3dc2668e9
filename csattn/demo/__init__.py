"""``csattn demo``'s attention part: the stack checks (``stack.py``), then with ``--cp N`` the CP=N parity
table (``cp.py``). The model part is ``csattn/train/demo.py``."""

from __future__ import annotations

import argparse

from .cp import run_cp_demo
from .stack import add_demo_args, build_demo_stack, demo_batch, demo_config, run_stack, run_stack_demo

__all__ = ["run_demo", "add_demo_args", "build_demo_stack", "demo_batch", "demo_config", "run_stack",
           "run_cp_demo"]


def run_demo(args: argparse.Namespace) -> int:
    """The stack checks, then the CP parity table with ``--cp N`` (N > 1); 0 when every check passed."""
    rc = run_stack_demo(args)
    if rc == 0 and getattr(args, "cp", 1) > 1:
        return run_cp_demo(args)
    return rc
