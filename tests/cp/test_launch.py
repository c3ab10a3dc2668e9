"""Local ranks start from a fork server (``csattn.cp.launch``) yet behave as spawned ones: each takes its caller's
environment and standard output at the time it starts, not the server's, and a rank's error reaches the caller."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

from csattn.cp import launch
from csattn.cp.launch import start_ranks


def _say(rank: int, tag: str) -> None:
    print(f"rank {rank} says {tag} with {os.environ.get('CSATTN_LAUNCH_TEST')}", flush=True)


def _fail(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 refuses")


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_take_the_callers_environment_and_stdout(capfd, monkeypatch, method):
    if method == "spawn":  # the platforms without a fork server, and machines with a GPU
        monkeypatch.setattr(launch.multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    expected = method if sys.platform.startswith("linux") and not torch.cuda.is_available() else "spawn"
    assert launch.rank_context().get_start_method() == expected
    with capfd.disabled():  # the server (if this call starts it) sees another stdout and no variable
        start_ranks(_say, ("early",), 1)
    monkeypatch.setenv("CSATTN_LAUNCH_TEST", "set later")
    start_ranks(_say, ("late",), 2)
    out = capfd.readouterr().out.splitlines()
    assert sorted(out) == ["rank 0 says late with set later", "rank 1 says late with set later"]


def test_a_ranks_error_reaches_the_caller():
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 refuses"):
        start_ranks(_fail, (), 2)
