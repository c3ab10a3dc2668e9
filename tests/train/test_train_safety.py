"""Checkpoints load without running code, and ``csattn train`` says clearly what is wrong and what it did:
old pickled trainer states are refused saying what to do, resuming with other data is refused, the final
checkpoint is written and its path printed, and misuse of --device / --cp / --init-from is explained."""

import os
import shutil
import warnings

import pytest
import torch

from csattn.cli import main
from csattn.train.checkpoint import MANIFEST, STATE_NAME, read_trainer_state
from csattn.train.checkpoint.layout import LEGACY_STATE_NAME
from csattn.train.checkpoint.safe_state import load_state, save_state
from csattn.train.run import TrainConfig, train

SMALL = dict(seq_len=32, device="cpu", progress=False, warmup_steps=1)


class _Payload:
    """Unpickling this calls ``open(marker, "w")``: it stands for any code a malicious pickle could run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_era_checkpoint_is_refused_in_one_line_and_never_runs(tmp_path, capsys):
    """A checkpoint of csattn before DCP (HF-format model files and a pickled ``trainer_state.pt``) is never
    unpickled: ``--resume`` refuses it in one line saying what to do, ``--resume auto`` names it and starts afresh,
    and the advice (``--init-from`` it) works. ``--trust-checkpoint`` is gone."""
    out = str(tmp_path / "run")
    train(TrainConfig(steps=1, output=out, **SMALL))
    ckpt = os.path.join(out, "checkpoint-000001")
    for name in (STATE_NAME, MANIFEST):
        os.remove(os.path.join(ckpt, name))
    shutil.rmtree(os.path.join(ckpt, "dcp"))
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "x": _Payload(str(marker))}, os.path.join(ckpt, LEGACY_STATE_NAME))  # keeps __reduce__
    args = ["train", "--steps", "2", "--seq-len", "32", "--no-progress", "--device", "cpu"]
    assert main(args + ["--resume", ckpt]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"csattn train: error: checkpoint {ckpt} was written by an older csattn (a pickled "
                   "trainer_state.pt, before DCP checkpoints), which this csattn does not read: start a new run from "
                   f"its HF-format model files with --init-from {ckpt} (export them with the older csattn if it has "
                   "none), or re-create the checkpoint"], err
    with pytest.raises(ValueError, match=r"pickled trainer_state\.pt"):
        read_trainer_state(ckpt)
    fresh = train(TrainConfig(steps=1, output=out, resume="auto", **SMALL))
    text = capsys.readouterr().out
    assert fresh.start_step == 0 and f"skipping {ckpt}: no manifest.json" in text and "--init-from" in text
    assert f"moved the earlier {ckpt} aside to {ckpt}.incomplete" in text  # nothing is deleted
    assert train(TrainConfig(steps=1, init_from=ckpt + ".incomplete", **SMALL)).losses
    assert not marker.exists()
    with pytest.raises(SystemExit):
        main(args + ["--trust-checkpoint"])


def test_safe_state_round_trip_is_exact_and_typed(tmp_path):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3, 2))], lr=1e-3, betas=(0.9, 0.95))
    opt.param_groups[0]["params"][0].grad = torch.randn(3, 2)
    opt.step()
    state = {"optimizer": opt.state_dict(), "rng": torch.get_rng_state(), "f": [0.1, float("inf"), None, True],
             "t": (1, "a"), "__odd": {3: "x"}}
    path = str(tmp_path / "s.safetensors")
    save_state(path, state)
    got = load_state(path)
    assert got["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]  # betas stay a tuple
    assert list(got["optimizer"]["state"]) == [0]  # integer parameter ids stay integers
    for k, v in state["optimizer"]["state"][0].items():
        assert torch.equal(got["optimizer"]["state"][0][k], v) and got["optimizer"]["state"][0][k].dtype == v.dtype
    assert torch.equal(got["rng"], state["rng"])
    assert got["f"] == state["f"] and got["t"] == (1, "a") and got["__odd"] == {3: "x"}
    with pytest.raises(TypeError, match=r"state\['bad'\] is a object"):
        save_state(path, {"bad": object()})


def test_resume_with_other_data_is_refused_and_schedule_change_warned(tmp_path):
    out = str(tmp_path / "run")
    train(TrainConfig(steps=2, output=out, save_every=1, **SMALL))
    ckpt = os.path.join(out, "checkpoint-000001")
    with pytest.raises(ValueError, match=r"--data 'pysrc' \(checkpoint: 'synthetic'\).*--init-from"):
        train(TrainConfig(steps=2, resume=ckpt, data="pysrc", **SMALL))
    with pytest.raises(ValueError, match=r"--doc-max-len 50 \(checkpoint: 96\)"):
        train(TrainConfig(steps=2, resume=ckpt, doc_max_len=50, **SMALL))
    with pytest.warns(UserWarning, match=r"--steps 3 differs from the checkpoint's 2: the LR schedule"):
        train(TrainConfig(steps=3, resume=ckpt, **SMALL))


def test_output_alone_saves_the_final_checkpoint_and_prints_paths(tmp_path, capsys):
    out = str(tmp_path / "run")
    train(TrainConfig(steps=2, output=out, **SMALL))
    names = os.listdir(out)
    assert sorted(n for n in names if n.startswith("checkpoint-")) == ["checkpoint-000002"] and "latest" in names
    text = capsys.readouterr().out
    assert f"saved checkpoint {os.path.join(out, 'checkpoint-000002')}" in text
    with pytest.warns(UserWarning, match="--steps 3"):  # a longer run re-stretches the LR schedule
        train(TrainConfig(steps=3, output=out, resume="auto", **SMALL))
    text = capsys.readouterr().out
    assert f"resuming from {os.path.join(out, 'checkpoint-000002')} at step 2" in text
    assert f"saved checkpoint {os.path.join(out, 'checkpoint-000003')}" in text


def test_init_from_without_mtp_tensors_warns(tmp_path):
    from tests.models.model_utils import tiny_model

    tiny_model("pro", seed=3, mtp=0).save_pretrained(str(tmp_path / "init"))
    with pytest.warns(UserWarning, match=r"--init-from .*no mtp\.\* tensors; the 1 MTP block\(s\) start from fresh"):
        train(TrainConfig(steps=1, init_from=str(tmp_path / "init"), mtp_layers=1, **SMALL))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no MTP requested: nothing to warn about
        train(TrainConfig(steps=1, init_from=str(tmp_path / "init"), mtp_layers=0, **SMALL))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_device_cuda_without_cuda_says_what_to_do():
    with pytest.raises(ValueError, match=r"--device cuda: .*--device cpu"):
        train(TrainConfig(steps=1, seq_len=32, device="cuda", progress=False))


def test_cp_in_one_process_points_to_torchrun():
    with pytest.raises(ValueError, match=r"--cp 2 .*torchrun --nproc-per-node 2 -m csattn train --cp 2"):
        train(TrainConfig(steps=1, seq_len=32, cp=2, device="cpu", progress=False))
