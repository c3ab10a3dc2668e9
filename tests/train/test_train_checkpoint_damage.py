"""A damaged or incomplete checkpoint never ends ``csattn train`` with a traceback and is never trusted: every
checkpoint carries a manifest (each file's size and sha256, written last) that is checked before a resume.
``--resume auto`` skips a damaged newest checkpoint, naming it and why in one line, and resumes the newest intact one;
an explicit ``--resume`` of a damaged one is one ``csattn train: error:`` line (exit 2); ``--keep-last`` never counts
a damaged checkpoint and nothing damaged is deleted; on 2 gloo ranks both ranks resume the same older checkpoint."""

import json
import os
import re
import shutil
import warnings

import pytest
import torch

from csattn.cli import main
from csattn.train.checkpoint import MANIFEST, prune_checkpoints, verify_checkpoint
from csattn.train.errors import UserError
from csattn.train.run import TrainConfig, train

ARGS = ["train", "--seq-len", "32", "--no-progress", "--device", "cpu", "--warmup-steps", "1"]


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def _flip_byte(path: str) -> None:
    """Same size, other content: only the sha256 tells."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


# case -> (how to damage the checkpoint, what the one line says about it)
DAMAGE = {
    "trainer_state": (lambda c: _truncate(os.path.join(c, "trainer_state.safetensors")),
                      r"trainer_state\.safetensors is \d+ bytes, its manifest says \d+ \(truncated\)"),
    "distcp": (lambda c: _truncate(os.path.join(c, "dcp", "__0_0.distcp")),
               r"dcp/__0_0\.distcp is \d+ bytes, its manifest says \d+ \(truncated\)"),
    "metadata": (lambda c: _truncate(os.path.join(c, "dcp", ".metadata")),
                 r"dcp/\.metadata is \d+ bytes, its manifest says \d+ \(truncated\)"),
    "hf_export": (lambda c: _truncate(os.path.join(c, "model.safetensors")),
                  r"model\.safetensors is \d+ bytes, its manifest says \d+ \(truncated\)"),
    "no_manifest": (lambda c: os.remove(os.path.join(c, MANIFEST)),
                    r"no manifest\.json \(written last, once every file is on disk\)"),
    "flipped_byte": (lambda c: _flip_byte(os.path.join(c, "dcp", "__0_0.distcp")),
                     r"dcp/__0_0\.distcp has another sha256 than its manifest says"),
    "missing_file": (lambda c: os.remove(os.path.join(c, "config.json")), r"config\.json is missing"),
}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> str:
    """Two checkpoints (steps 1 and 2), each with its HF export, written through the command line."""
    out = str(tmp_path_factory.mktemp("base") / "run")
    torch.set_num_threads(1)
    assert main(ARGS + ["--steps", "2", "--save-every", "1", "--export-hf", "every", "--output", out]) == 0
    return out


def _copy(base: str, tmp_path) -> tuple[str, str, str]:
    run = str(tmp_path / "run")
    shutil.copytree(base, run)
    return run, os.path.join(run, "checkpoint-000001"), os.path.join(run, "checkpoint-000002")


def _damaged(case: str, base: str, tmp_path) -> tuple[str, str, str, str]:
    """A copy of the base run with its newest checkpoint damaged as ``case`` says: (run, older, newest, why)."""
    damage, why = DAMAGE[case]
    run, older, newest = _copy(base, tmp_path)
    damage(newest)
    return run, older, newest, why


def _losses(run: str) -> dict[int, float]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_resume_auto_skips_a_damaged_newest_checkpoint_in_one_line(case, base_run, tmp_path, capsys):
    run, older, newest, why = _damaged(case, base_run, tmp_path)
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(ARGS + ["--steps", "2", "--output", run, "--resume", "auto"]) == 0
    out, err = capsys.readouterr()
    warned = [line for line in out.splitlines() if line.startswith("csattn train: warning: --resume")]
    assert len(warned) == 1, out
    head = "csattn train: warning: --resume auto: skipping"
    assert re.fullmatch(rf"{head} {re.escape(newest)}: {why}.*", warned[0]), warned[0]
    assert f"resuming from {older} at step 1" in out
    assert "Traceback" not in err and not [w for w in caught if "torch.distributed is disabled" in str(w.message)]
    # step 2 again from step 1's checkpoint: the same loss as the first run's step 2
    assert _losses(run)[2] == _losses(base_run)[2]
    # nothing deleted: the damaged checkpoint was moved aside by the new step-2 save, which is intact
    kind = "incomplete" if case == "no_manifest" else "damaged"
    assert f"note: moved the earlier {newest} aside to {newest}.{kind} before saving over it" in out
    assert os.path.isdir(f"{newest}.{kind}") and verify_checkpoint(newest) is None


@pytest.mark.parametrize("case", list(DAMAGE))
def test_explicit_resume_of_a_damaged_checkpoint_is_one_error_line(case, base_run, tmp_path, capsys):
    run, _, newest, why = _damaged(case, base_run, tmp_path)
    capsys.readouterr()
    assert main(ARGS + ["--steps", "3", "--resume", newest]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    state = "incomplete" if case == "no_manifest" else "damaged"
    assert len(lines) == 1 and re.match(rf"csattn train: error: --resume '{re.escape(newest)}' is {state}: {why}",
                                        lines[0]), err


def test_no_intact_checkpoint_starts_from_step_0_saying_so(base_run, tmp_path, capsys):
    run, older, newest = _copy(base_run, tmp_path)
    _truncate(os.path.join(newest, "dcp", ".metadata"))
    os.remove(os.path.join(older, MANIFEST))
    capsys.readouterr()
    result = train(TrainConfig(steps=1, seq_len=32, device="cpu", progress=False, warmup_steps=1, output=run,
                               resume="auto", export_hf="never"))
    out = capsys.readouterr().out.splitlines()
    assert result.start_step == 0
    warned = [line for line in out if line.startswith("csattn train: warning: --resume")]
    assert len(warned) == 2 and f"skipping {newest}: dcp/.metadata is " in warned[0], out
    assert f"skipping {older}: no manifest.json" in warned[1]
    assert f"--resume auto: no intact checkpoint under {run}: starting from step 0" in out


def test_keep_last_never_counts_a_damaged_checkpoint(base_run, tmp_path, capsys):
    run, older, newest = _copy(base_run, tmp_path)
    _truncate(os.path.join(newest, "trainer_state.safetensors"))
    # the newest intact checkpoint is never removed, nor the damaged one
    assert prune_checkpoints(run, 1) == []
    # resumed from step 1 and saved step 3: the 2 newest intact ones are 3 and 1; the damaged 2 stays
    assert main(ARGS + ["--steps", "3", "--output", run, "--resume", "auto", "--keep-last", "2"]) == 0
    assert sorted(n for n in os.listdir(run) if n.startswith("checkpoint-")) == [
        "checkpoint-000001", "checkpoint-000002", "checkpoint-000003"]
    assert prune_checkpoints(run, 1) == [older]
    assert sorted(n for n in os.listdir(run) if n.startswith("checkpoint-")) == [
        "checkpoint-000002", "checkpoint-000003"]
    assert verify_checkpoint(os.path.join(run, "checkpoint-000003")) is None and verify_checkpoint(newest)


def _two_rank_worker(rank: int, world: int, port: int, out: str) -> None:
    """Two steps with a checkpoint each; rank 0 truncates rank 1's shard of the newest; then an explicit --resume
    of the damaged one and --resume auto, each rank writing what it got."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = dict(seq_len=64, device="cpu", progress=False, warmup_steps=1, dp_shard=2, output=os.path.join(out, "run"),
               export_hf="never")
    try:
        train(TrainConfig(steps=2, save_every=1, **cfg))
        newest = os.path.join(out, "run", "checkpoint-000002")
        with open(os.path.join(newest, MANIFEST)) as f:
            listed = sorted(json.load(f)["files"])
        if rank == 0:
            _truncate(os.path.join(newest, "dcp", "__1_0.distcp"))
        dist.barrier()
        try:
            train(TrainConfig(steps=2, **{**cfg, "output": None}, resume=newest))
            explicit = "resumed"
        except UserError as e:
            explicit = str(e)
        resumed = train(TrainConfig(steps=2, resume="auto", **cfg))
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"listed": listed, "start": resumed.start_step, "losses": resumed.losses, "explicit": explicit}, f)


@pytest.mark.slow
def test_both_ranks_resume_the_same_older_checkpoint(tmp_path):
    from csattn.cp.launch import free_port, start_ranks

    start_ranks(_two_rank_worker, (2, free_port(), str(tmp_path)), 2)
    got = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert got[0] == got[1], got
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "trainer_state.safetensors"} <= set(
        got[0]["listed"])
    assert got[0]["start"] == 1 and len(got[0]["losses"]) == 1
    assert got[0]["explicit"].startswith(f"--resume '{tmp_path / 'run' / 'checkpoint-000002'}' is damaged: "
                                         "dcp/__1_0.distcp is ")


def test_init_from_a_truncated_checkpoint_is_one_error_line(base_run, tmp_path, capsys):
    run, _, newest = _copy(base_run, tmp_path)
    _truncate(os.path.join(newest, "model.safetensors"))
    capsys.readouterr()
    assert main(ARGS + ["--steps", "1", "--init-from", newest]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"csattn train: error: --init-from '{newest}' is a damaged "
                                                   "checkpoint: model.safetensors is "), lines


def test_a_manifest_is_trusted_only_when_whole_and_inside_its_checkpoint(base_run, tmp_path):
    run, _, newest = _copy(base_run, tmp_path)
    manifest = os.path.join(newest, MANIFEST)
    with open(manifest) as f:
        data = json.load(f)
    assert verify_checkpoint(newest) is None
    assert sorted(data["files"]) == ["config.json", "dcp/.metadata", "dcp/__0_0.distcp", "model.safetensors",
                                     "trainer_state.safetensors"]
    data["files"]["../../elsewhere"] = {"size": 1, "sha256": "0" * 64}  # a manifest never makes us read other files
    with open(manifest, "w") as f:
        json.dump(data, f)
    assert verify_checkpoint(newest) == ("manifest.json is not a csattn checkpoint manifest "
                                         "(csattn-checkpoint-manifest-1)")
    _truncate(manifest)
    assert verify_checkpoint(newest).startswith("manifest.json is unreadable (JSONDecodeError")
