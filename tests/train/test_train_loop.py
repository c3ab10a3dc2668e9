"""``csattn train`` in one process: the loss goes down, a save / resume round trip reproduces the next steps
exactly, mismatched checkpoints fail naming the tensor, and ``--help`` documents every option."""

import argparse
import dataclasses
import json
import os

import pytest
import torch

from csattn.cli import build_parser, main
from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM
from csattn.train.build import build_model_config
from csattn.train.run import TrainConfig, train

SMALL = dict(seq_len=64, device="cpu", progress=False, warmup_steps=2)


def test_loss_goes_down():
    cfg = TrainConfig(steps=24, lr=1e-2, min_lr=1e-3, **SMALL)
    torch.manual_seed(cfg.seed)
    initial = DeepseekV4ForCausalLM(build_model_config(cfg)).state_dict()
    result = train(cfg)
    first, last = sum(result.losses[:4]) / 4, sum(result.losses[-4:]) / 4
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert last < first - 0.4, result.losses
    assert result.indexer_losses[0] > 0  # CSA layers train their indexer ...
    final = result.model.state_dict()
    key = "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"
    assert not torch.equal(final[key], initial[key])  # ... through the indexer loss only
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.count_nonzero(final[bias]) > 0 and torch.count_nonzero(initial[bias]) == 0  # load balancing


def test_resume_reproduces_next_steps_exactly(tmp_path):
    out = str(tmp_path / "run")
    full = train(TrainConfig(steps=4, output=out, save_every=2, **SMALL))
    assert sorted(os.listdir(out)) == ["checkpoint-000002", "checkpoint-000004", "latest", "loss.png", "metrics.jsonl"]
    resumed = train(TrainConfig(steps=4, output=out, resume=os.path.join(out, "checkpoint-000002"), **SMALL))
    assert resumed.start_step == 2
    assert resumed.losses == full.losses[2:]  # bitwise
    a, b = full.model.state_dict(), resumed.model.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # resumed at step 2, the metrics file drops its lines after step 2 and the run logs steps 3, 4 again: each
    # step once, with the same losses
    with open(os.path.join(out, "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert [r["loss"] for r in logged] == full.losses
    assert all({"lm_loss", "indexer_loss", "lr", "tokens_per_s", "nonfinite"} <= set(r) for r in logged)
    # resume auto picks the latest; nothing is left to do at step 4
    done = train(TrainConfig(steps=4, output=out, resume="auto", **SMALL))
    assert done.start_step == 4 and done.losses == []


def test_resume_into_another_config_names_the_tensor(tmp_path):
    out = str(tmp_path / "run")
    train(TrainConfig(steps=1, output=out, save_every=1, **SMALL))
    with pytest.raises(ValueError, match=r"tensor 'model\.[\w.]+' .*has shape \(256"):
        train(TrainConfig(steps=2, output=out, resume="auto", vocab_size=300, **SMALL))


def _train_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def test_help_documents_every_option(capsys):
    parser = _train_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    for action in options:
        assert action.help and len(action.help) > 10, action.option_strings
    dests = {a.dest for a in options}
    for f in dataclasses.fields(TrainConfig):
        assert f.name in dests or f.name == "progress", f"TrainConfig.{f.name} has no option"
    assert "no_progress" in dests
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for action in options:
        assert action.option_strings[0] in text


def test_cli_runs(tmp_path, capsys):
    out = str(tmp_path / "cli")
    assert main(["train", "--steps", "2", "--seq-len", "32", "--no-progress", "--output", out, "--save-every", "2",
                 "--data", "synthetic", "--pad-multiple", "4"]) == 0
    assert "loss" in capsys.readouterr().out
    assert os.path.isfile(os.path.join(out, "checkpoint-000002", "model.safetensors"))
    with pytest.raises(ValueError, match="divisible by --cp"):
        train(TrainConfig(steps=1, seq_len=30, cp=4, device="cpu", progress=False))


def test_init_from_hf_format_checkpoint(tmp_path):
    from tests.models.model_utils import tiny_model

    start = tiny_model("pro", seed=9, mtp=1)
    start.save_pretrained(str(tmp_path / "init"))
    cfg = TrainConfig(steps=1, lr=0.0, min_lr=0.0, weight_decay=0.0, router_bias_rate=0.0,
                      init_from=str(tmp_path / "init"), **SMALL)
    result = train(cfg)
    a, b = start.state_dict(), result.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:  # the weights are the checkpoint's
        assert torch.equal(a[k], b[k]), k
    assert len(result.model.mtp) == 1 and torch.isfinite(torch.tensor(result.losses)).all()


def test_keep_last_prunes_old_checkpoints_and_resumes(tmp_path):
    out = str(tmp_path / "run")
    train(TrainConfig(steps=3, output=out, save_every=1, keep_last=1, **SMALL))
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-000003"]
    done = train(TrainConfig(steps=4, output=out, resume="auto", keep_last=1, **SMALL))
    assert done.start_step == 3 and len(done.losses) == 1
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-000004"]
