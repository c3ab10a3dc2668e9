"""``benchmarks.soak`` on the CPU: the tiny ``csattn train --deterministic`` run killed with SIGKILL and resumed ends
bitwise equal to an uninterrupted run (losses at every step and final weights), and the JSON carries the page's
``meta`` and one result record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # three training processes and a resume, about a minute on two cores
def test_soak_killed_deterministic_run_is_bitwise(tmp_path):
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--seconds", "240", "--kills", "1",
                          "--save-every", "3", "--out", str(tmp_path / "runs"), "--json", str(out),
                          "--commit", "abc1234", "--", "--deterministic", "--steps", "8", "--seq-len", "128",
                          "--log-every", "1"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["meta"]["commit"] == "abc1234"
    (r,) = data["results"]
    assert r["steps"] == 8 and len(r["kills"]) == 1 and r["kills"][0]["last_step_logged"] >= 5
    assert r["bitwise_equal_losses"] == {"killed": True, "again": True}
    assert r["bitwise_equal_weights"] == {"killed": True, "again": True}
