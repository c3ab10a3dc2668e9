"""Run the measurement stages of the results page: each source's command in its own process, with its timeout.

A stage list and a total budget keep one call within what the machine lends (``--budget-s``): a command whose
timeout would run past the budget gets what is left, and none starts with less than a minute left. The end
prints each command's exit status and seconds, to check the stage times in ``sources.py`` against.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .sources import STAGES, Source

__all__ = ["run_stages"]

MIN_START_S = 60  # a command needs its process start, imports and model build before it measures anything


def _run(src: Source, json_dir: Path, commit: str, timeout_s: float) -> int:
    """Run ``src``'s command; on timeout kill its whole process group (the report's ranks too). Returns its status."""
    env = {**os.environ, **dict(src.env), "CSATTN_COMMIT": commit}
    with tempfile.TemporaryDirectory() as tmp:
        out = tmp if src.is_report else str(json_dir / src.file)
        proc = subprocess.Popen([sys.executable, "-m", src.module, *src.argv(out, commit)], env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
        if src.is_report and os.path.exists(os.path.join(tmp, "report.json")):
            shutil.copy(os.path.join(tmp, "report.json"), json_dir / src.file)  # what it measured, even if cut short
    return rc


def run_stages(stages: list[str], json_dir: Path, commit: str, budget_s: float | None = None) -> list[dict]:
    """Run ``stages`` (names of :data:`STAGES`) in order, writing their JSON into ``json_dir``; returns the log."""
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stages {unknown}; the stages are {list(STAGES)}")
    json_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    log: list[dict] = []
    for stage in stages:
        if not STAGES[stage]:
            print(f"[{stage}] no command yet: this stage's numbers are written by other means", flush=True)
        for src in STAGES[stage]:
            left = None if budget_s is None else budget_s - (time.monotonic() - start)
            entry = {"stage": stage, "file": src.file, "command": src.command()}
            if left is not None and left < MIN_START_S:
                print(f"[{stage}] {src.file}: skipped, {left:.0f} s of the budget left", flush=True)
                log.append({**entry, "skipped": f"{left:.0f} s of the budget left"})
                continue
            timeout = src.timeout_s if left is None else min(src.timeout_s, left)
            print(f"[{stage}] {src.command()}  (at most {timeout:.0f} s)", flush=True)
            t0 = time.monotonic()
            rc = _run(src, json_dir, commit, timeout)
            entry.update(rc=rc, seconds=round(time.monotonic() - t0, 1))
            print(f"[{stage}] {src.file}: rc {rc} in {entry['seconds']} s", flush=True)
            log.append(entry)
    print(json.dumps(log, indent=1), flush=True)
    return log
