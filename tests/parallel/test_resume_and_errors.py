"""DCP checkpoints resume on other meshes exactly; a rank killed mid-run makes the others exit instead of hanging
and the run resumes on another mesh; bad input gives one clear error on every rank and never a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from csattn.cp.launch import free_port
from csattn.train.config import tiny_model_config
from csattn.train.demo import run_spawned
from csattn.train.run import TrainConfig, train
from tests.cp_pool import RankPool
from tests.parallel.tasks import BASE, error_task

pytestmark = pytest.mark.slow

RUN = {**BASE, "steps": 4}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def test_save_on_4_ranks_resume_on_2_and_on_1(tmp_path):
    """Saved at step 2 by dp_shard 2 x cp 2 and resumed there: bit for bit the uninterrupted run. Resumed by
    dp_shard 2 x ep 2 (2 ranks) and by one process: steps 3
    and 4 equal the uninterrupted 4-rank run to 1e-12 (fp64), and so does every final weight, except where two
    uninterrupted runs on the two meshes already differ by more (the meshes sum gradients in different orders,
    which Adam's normalization turns into relative weight differences of a few 1e-12 on the mHC bases): there
    the resumed weights are no further from the 4-rank run than the other mesh's uninterrupted run is."""
    out = str(tmp_path / "run")
    full = run_spawned(4, TrainConfig(**RUN, dp_shard=2, cp=2, output=out, save_every=2))
    ckpt = os.path.join(out, "checkpoint-000002")
    assert os.path.isdir(os.path.join(ckpt, "dcp"))
    # on the mesh that saved it, the resumed run is the uninterrupted one, bit for bit
    same = run_spawned(4, TrainConfig(**RUN, dp_shard=2, cp=2, resume=ckpt))
    assert same["losses"] == full["losses"][2:]
    assert all(torch.equal(same["state"][k], v) for k, v in full["state"].items())
    two = run_spawned(2, TrainConfig(**RUN, dp_shard=2, ep=2, resume=ckpt))
    two_straight = run_spawned(2, TrainConfig(**RUN, dp_shard=2, ep=2))
    one = train(TrainConfig(**RUN, resume=ckpt))
    one_straight = train(TrainConfig(**RUN)).model.state_dict()
    one_state = one.model.state_dict()
    for got in (two["losses"], one.losses):
        assert len(got) == 2
        for a, b in zip(got, full["losses"][2:], strict=True):
            assert abs(a - b) <= 1e-12 * abs(b)
    for k, v in full["state"].items():
        if v.is_floating_point():
            assert _rel(two["state"][k], v) <= max(1e-12, _rel(two_straight["state"][k], v)), k
            assert _rel(one_state[k], v) <= max(1e-12, _rel(one_straight[k], v)), k
        else:
            assert torch.equal(two["state"][k], v) and torch.equal(one_state[k], v), k


def _launch(world: int, port: int, args: list[str], log_dir: str) -> list[subprocess.Popen]:
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        log = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "csattn", "train", *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    return procs


def test_killed_rank_does_not_hang_the_others_and_the_run_resumes_on_another_mesh(tmp_path):
    out = str(tmp_path / "run")
    args = ["--steps", "8", "--seq-len", "64", "--device", "cpu", "--no-progress", "--warmup-steps", "1",
            "--dtype", "float64", "--pad-multiple", "4", "--dp-shard", "2", "--cp", "2", "--output", out,
            "--save-every", "2", "--dist-timeout", "20", "--export-hf", "never"]
    procs = _launch(4, free_port(), args, str(tmp_path))
    deadline = time.time() + 240
    # the kill waits for a whole checkpoint: "latest" is written once every file of one is in (a kill between its
    # trainer state and that pointer leaves no checkpoint to resume, as it should)
    while time.time() < deadline and not os.path.isfile(os.path.join(out, "latest")):
        time.sleep(0.2)
    assert os.path.isdir(os.path.join(out, "checkpoint-000002")), "no checkpoint was written"
    procs[3].send_signal(signal.SIGKILL)
    start = time.time()
    codes = [p.wait(timeout=120) for p in procs[:3]]
    assert time.time() - start < 60 and all(c != 0 for c in codes), codes
    latest = open(os.path.join(out, "latest")).read().strip()
    step = int(latest.split("-")[1])
    assert 2 <= step < 8
    resumed = run_spawned(2, TrainConfig(**{**BASE, "steps": 8, "batch_seqs": 0}, dp_shard=2, output=out,
                                         resume="auto"))
    straight = train(TrainConfig(**{**BASE, "steps": 8, "batch_seqs": 2}))
    assert len(resumed["losses"]) == 8 - step
    for a, b in zip(resumed["losses"], straight.losses[step:], strict=True):
        assert abs(a - b) <= 1e-10 * abs(b)


@pytest.fixture(scope="module")
def short_pool():
    pool = RankPool(4, timeout=180, pg_timeout_s=30)  # a hang would fail within 30 s
    yield pool
    pool.close()


def _errors(pool: RankPool, **kwargs) -> list[str]:
    res = pool.run(error_task, 4, **kwargs)
    assert all(status == "error" for status, _ in res), res
    assert all(value[0] in ("ValueError", "UserError") for _, value in res), [v[:2] for _, v in res]
    messages = [value[1] for _, value in res]
    assert len(set(messages)) == 1, messages  # the same decision on every rank
    return messages


def test_bad_input_one_clear_error_on_every_rank(short_pool, tmp_path):
    assert "--dp-shard 3" in _errors(short_pool, dp_shard=3)[0]  # 3 ranks on a world of 4
    assert "--ep 3 must divide" in _errors(short_pool, ep=3)[0]
    six = tmp_path / "six.json"
    six.write_text(json.dumps(tiny_model_config(n_routed_experts=6).to_hf_dict()))
    assert "num_experts (6) must be divisible" in _errors(short_pool, ep=4, config_json=str(six))[0]
    # the balanced partition deals 4 chunks per rank: 32-row streams give chunks shorter than the window halo
    message = _errors(short_pool, cp=2, cp_partition="balanced", seq_len=32, batch_seqs=2)[0]
    assert "balanced" in message or "halo" in message or "chunk" in message, message


def test_resume_of_another_model_or_tokenizer_fails_on_every_rank(short_pool, tmp_path):
    out = str(tmp_path / "run")
    train(TrainConfig(**{**BASE, "steps": 1, "batch_seqs": 2}, output=out))
    ckpt = os.path.join(out, "checkpoint-000001")
    assert "has shape" in _errors(short_pool, resume=ckpt, vocab_size=300, dp_shard=2, cp=2)[0]
    assert "--tokenizer" in _errors(short_pool, resume=ckpt, data="jsonl", data_path=[str(tmp_path / "x.jsonl")],
                                    tokenizer=str(tmp_path))[0]
