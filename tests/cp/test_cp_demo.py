"""``csattn demo --cp N``: the main job's context-parallel parity table."""

from __future__ import annotations

import pytest

from csattn.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # ranks on the CPU


def test_demo_cp_prints_parity_table(capfd):
    rc = main(["demo", "--only", "stack", "--cp", "2", "--cp-partition", "balanced",
               "--lengths", "5", "37", "1", "64", "19", "100"])
    out = capfd.readouterr().out  # the ranks print from their own processes
    assert rc == 0, out
    assert "packed run matches per-document runs" in out  # the CP=1 part is unchanged
    assert "CP=2 matches CP=1 within 1e-10" in out
    for row in ("stack output", "input grad", "grad 1.compressor.indexer.q_b_proj.weight", "indexer loss (layer 1)",
                "per-rank saved activations"):
        assert row in out


def test_default_demo_runs_both_parts(capsys):
    from csattn.cli import main

    assert main(["demo", "--lengths", "9", "30", "--model-steps", "2", "--model-seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "packed run matches per-document runs" in out and "CP=2" in out
