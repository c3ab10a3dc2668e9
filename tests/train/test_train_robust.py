"""``csattn train`` against divergence and user mistakes: non-finite steps are skipped (weights and optimizer
state unchanged) and stop the run after ``--max-bad-steps``; non-finite weights are never saved and ``--keep-last``
keeps the last good checkpoint; bad option values fail at parse time naming the flag; user mistakes end in one line
without a traceback; ``--resume auto`` says when it starts fresh; time-based checkpoints."""

import argparse
import os

import pytest
import torch
from safetensors.torch import load_file

from csattn.cli import build_parser, main
from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM
from csattn.train import build, run
from csattn.train.errors import TrainingStopped, UserError
from csattn.train.run import TrainConfig, train

SMALL = dict(seq_len=32, device="cpu", progress=False, warmup_steps=1)


def _checkpoints(out: str) -> list[str]:
    return sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))


def _poison_from(monkeypatch, first_call: int, what: str) -> None:
    """From the ``first_call``-th forward on, a NaN loss (``what="loss"``) or a finite loss whose gradients are NaN
    (``what="grad"``)."""
    forward, calls = DeepseekV4ForCausalLM.forward, []

    def poisoned(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        calls.append(1)
        if len(calls) >= first_call:
            if what == "loss":
                out.loss = out.loss * float("nan")
            else:
                out.loss.register_hook(lambda g: g * float("nan"))
        return out

    monkeypatch.setattr(DeepseekV4ForCausalLM, "forward", poisoned)


def _record_steps(monkeypatch) -> list[dict]:
    """After each step: the model's weights and the AdamW step count of its first parameter."""
    step, seen = run.train_step, []

    def recorded(state, *args):
        finish = step(state, *args)

        def done():
            metrics = finish()
            optimizer = state.optimizer
            first = optimizer.state.get(optimizer.param_groups[0]["params"][0], {})
            seen.append({"weights": {k: v.clone() for k, v in state.model.state_dict().items()},
                         "adam_step": float(first["step"]) if "step" in first else 0.0, **metrics})
            return metrics
        return done

    monkeypatch.setattr(run, "train_step", recorded)
    return seen


@pytest.mark.parametrize("what", ["loss", "grad"])
def test_nonfinite_steps_are_skipped_then_the_run_stops(what, tmp_path, monkeypatch, capsys):
    _poison_from(monkeypatch, 3, what)
    seen = _record_steps(monkeypatch)
    out = str(tmp_path / "run")
    name = "loss and gradient norm" if what == "loss" else "gradient norm"  # a NaN loss gives NaN gradients
    with pytest.raises(TrainingStopped, match=rf"steps 3\.\.5: 3 non-finite steps in a row \(--max-bad-steps 3; "
                       rf"the last one: non-finite {name}\).*weights of step 2.*lower --lr"):
        train(TrainConfig(steps=10, output=out, save_every=1, keep_last=2, export_hf="every", max_bad_steps=3,
                          **SMALL))
    text = capsys.readouterr().out
    for step in (3, 4, 5):
        assert f"warning: step {step}: non-finite {name}: step skipped" in text
    assert [s["nonfinite"] for s in seen] == [None, None, name, name, name]
    assert [s["adam_step"] for s in seen] == [1, 2, 2, 2, 2]  # no optimizer step on a skipped step
    assert any(not torch.equal(seen[0]["weights"][k], v) for k, v in seen[1]["weights"].items())
    for later in seen[2:]:  # weights and router biases those of step 2
        for k, v in seen[1]["weights"].items():
            assert torch.equal(later["weights"][k], v), k
    # the checkpoints saved on skipped steps hold step 2's weights: finite; --keep-last kept the newest two (the
    # run stopped before saving step 5)
    assert _checkpoints(out) == ["checkpoint-000003", "checkpoint-000004"]
    for name in _checkpoints(out):
        weights = load_file(os.path.join(out, name, "model.safetensors"))
        assert all(torch.isfinite(t).all() for t in weights.values()), name


def test_a_run_recovers_from_fewer_bad_steps_than_the_limit(monkeypatch, capsys):
    forward, calls = DeepseekV4ForCausalLM.forward, []

    def one_bad(self, *args, **kwargs):  # the second step's loss only
        out = forward(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            out.loss = out.loss * float("inf")
        return out

    monkeypatch.setattr(DeepseekV4ForCausalLM, "forward", one_bad)
    result = train(TrainConfig(steps=3, max_bad_steps=1 + 1, **SMALL))
    assert len(result.losses) == 3 and not torch.isfinite(torch.tensor(result.losses[1]))
    assert "warning: step 2: non-finite loss" in capsys.readouterr().out


def test_nonfinite_weights_are_never_saved_and_keep_last_keeps_the_good_one(tmp_path, monkeypatch):
    step = run.train_step

    def breaks_weights(state, *args):
        finish = step(state, *args)
        model = state.model

        def done():
            metrics = finish()
            if int(model.optimizer_steps) == 2:  # after the second step's update
                with torch.no_grad():
                    model.lm_head.weight[0, 0] = float("nan")
            return metrics
        model.optimizer_steps = getattr(model, "optimizer_steps", 0) + 1
        return done

    monkeypatch.setattr(run, "train_step", breaks_weights)
    out = str(tmp_path / "run")
    with pytest.raises(TrainingStopped, match=r"step 2: the model's weights hold NaN or inf values: refusing to save "
                       r".*checkpoint-000002; the checkpoints already under .* are kept"):
        train(TrainConfig(steps=3, output=out, save_every=1, keep_last=1, export_hf="every", **SMALL))
    assert _checkpoints(out) == ["checkpoint-000001"]
    with open(os.path.join(out, "latest")) as f:
        assert f.read().strip() == "checkpoint-000001"
    weights = load_file(os.path.join(out, "checkpoint-000001", "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())


def _train_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


BASE = ["train", "--steps", "1", "--seq-len", "32", "--no-progress", "--device", "cpu"]


@pytest.mark.parametrize("argv, expected", [
    (["--lr", "nan"], r"argument --lr: must be a finite number >= 0"),
    (["--lr", "inf"], r"argument --lr: must be a finite number >= 0"),
    (["--lr=-1e-3"], r"argument --lr: must be a finite number >= 0"),
    (["--lr", "fast"], r"argument --lr: must be a finite number >= 0 .*got 'fast'"),
    (["--grad-clip", "nan"], r"argument --grad-clip: must be a finite number >= 0 \(0 = no clipping\)"),
    (["--grad-clip", "inf"], r"argument --grad-clip: must be a finite number >= 0"),
    (["--grad-clip", "-1"], r"argument --grad-clip: must be a finite number >= 0"),
    (["--min-lr=-1e-4"], r"argument --min-lr: must be a finite number >= 0 and <= --lr"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], r"--min-lr 0\.01 is above --lr 0\.001: .*pass a --min-lr <= --lr"),
    (["--save-every", "-1"], r"argument --save-every: must be an integer >= 0 \(0 = no step interval"),
    (["--save-every-minutes", "-5"], r"argument --save-every-minutes: must be a finite number >= 0"),
    (["--seq-len", "1"], r"argument --seq-len: must be an integer >= 2"),
    (["--steps", "0"], r"argument --steps: must be an integer >= 1"),
    (["--keep-last", "0"], r"argument --keep-last: must be an integer >= 1 \(leave it out to keep every"),
    (["--beta1", "1"], r"argument --beta1: must be a finite number in \[0, 1\)"),
    (["--beta2", "nan"], r"argument --beta2: must be a finite number in \[0, 1\)"),
    (["--adam-eps", "0"], r"argument --adam-eps: must be a finite number > 0"),
    (["--weight-decay", "inf"], r"argument --weight-decay: must be a finite number >= 0"),
    (["--max-bad-steps", "0"], r"argument --max-bad-steps: must be an integer >= 1"),
    (["--dist-timeout", "nan"], r"argument --dist-timeout: must be a finite number of seconds > 0"),
    (["--save-every", "2"], r"--save-every needs --output DIR"),
    (["--doc-min-len", "50", "--doc-max-len", "20"], r"--doc-min-len 50 is above --doc-max-len 20"),
])
def test_bad_option_values_are_refused_naming_the_flag(argv, expected, capsys):
    try:
        rc = main(BASE + argv)
    except SystemExit as e:  # argparse
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    import re

    assert re.search(expected, err), err


def test_option_values_at_their_limits_parse_and_the_api_refuses_alike():
    args = _train_parser().parse_args(["--grad-clip", "0", "--save-every", "0", "--min-lr", "0", "--beta1", "0"])
    assert args.grad_clip == 0.0 and args.save_every == 0 and args.min_lr == 0.0  # 0 = off / none
    for bad in (dict(lr=float("nan")), dict(grad_clip=-1.0), dict(keep_last=0), dict(seq_len=1), dict(steps=0),
                dict(adam_eps=float("inf")), dict(min_lr=1.0, lr=0.1)):
        with pytest.raises(UserError):
            TrainConfig(**bad).validate()


@pytest.mark.parametrize("argv, expected", [
    (["--data", "jsonl", "--data-path", "no/such.jsonl"], r"--data-path 'no/such\.jsonl': no such file"),
    (["--resume", "no/such/dir"], r"--resume 'no/such/dir' has no trainer_state"),
    (["--cp", "2"], r"--cp 2 .*torchrun"),
    (["--config-json", "no/such.json"], r"--config-json 'no/such\.json': no such file"),
    (["--init-from", "no/such/dir"], r"--init-from 'no/such/dir' is not a directory"),
])
def test_user_mistakes_end_in_one_line_without_traceback(argv, expected, capsys):
    assert main(BASE + argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("csattn train: error: "), err
    import re

    assert re.search(expected, lines[0]), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_triton_backend_without_cuda_is_refused_at_startup(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    built = []
    monkeypatch.setattr(build, "build_model", lambda *a: built.append(1))  # refused before the model is built
    assert main(BASE + ["--backend", "triton"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("csattn train: error: backend 'triton' runs the Triton kernels, which need CUDA tensors")
    assert "--backend auto" in err and "TRITON_INTERPRET=1" in err and not built
    assert "Traceback" not in err and "active drivers" not in err


def test_resume_auto_with_nothing_to_resume_says_so(tmp_path, capsys):
    out = str(tmp_path / "fresh")
    result = train(TrainConfig(steps=1, output=out, resume="auto", **SMALL))
    assert result.start_step == 0
    assert f"--resume auto: no checkpoint under {out}: starting from step 0" in capsys.readouterr().out


def test_time_based_checkpoints(tmp_path):
    assert TrainConfig(output="x").save_minutes == 30.0  # the default with --output and no --save-every
    assert TrainConfig(output="x", save_every=10).save_minutes == 0.0
    assert TrainConfig().save_minutes == 0.0  # nothing to save to
    out = str(tmp_path / "run")
    train(TrainConfig(steps=3, output=out, save_every_minutes=1e-9, **SMALL))  # due after every step
    assert _checkpoints(out) == ["checkpoint-000001", "checkpoint-000002", "checkpoint-000003"]


def _poisoned_rank_worker(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 alone gets a NaN loss from its second step on; every rank writes how its run ended."""
    import json

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    forward, calls = DeepseekV4ForCausalLM.forward, []

    def poisoned(self, *args, **kwargs):
        result = forward(self, *args, **kwargs)
        calls.append(1)
        if rank == 1 and len(calls) >= 2:
            result.loss = result.loss * float("nan")
        return result

    DeepseekV4ForCausalLM.forward = poisoned
    try:
        train(TrainConfig(**{**SMALL, "seq_len": 64}, steps=6, dp_shard=2, max_bad_steps=2))
        ended = "finished"
    except TrainingStopped as e:
        ended = str(e)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(ended, f)


@pytest.mark.slow
def test_every_rank_skips_and_stops_alike_when_one_rank_is_nonfinite(tmp_path):
    """Under torch.distributed (2 gloo ranks, FSDP over 2) a NaN loss on one rank only: the all-reduced flag makes
    both ranks skip the same steps and stop together with the same error (no rank left waiting in a collective)."""
    import json

    from csattn.cp.launch import free_port, start_ranks

    start_ranks(_poisoned_rank_worker, (2, free_port(), str(tmp_path)), 2)
    ended = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert ended[0] == ended[1] and ended[0].startswith("steps 2..3: 2 non-finite steps in a row"), ended


def test_deterministic_runs_are_bitwise_equal_and_the_mode_is_restored():
    """``--deterministic``: the model's kernels get fixed-point sums, torch's deterministic mode is on during the run
    and back off after it, and two runs give the same bits (losses and every weight)."""
    argv = ["train", "--deterministic", "--steps", "3", "--seq-len", "64", "--device", "cpu", "--no-progress"]
    args = build_parser().parse_args(argv)
    assert args.deterministic
    seen = []
    real = build.build_model

    def spy(cfg, model_cfg, *a, **k):
        seen.append((model_cfg.deterministic, torch.are_deterministic_algorithms_enabled()))
        return real(cfg, model_cfg, *a, **k)

    runs = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build, "build_model", spy)
        for _ in range(2):
            runs.append(train(TrainConfig(steps=3, seq_len=64, device="cpu", progress=False, deterministic=True)))
    assert seen == [(True, True), (True, True)]
    assert not torch.are_deterministic_algorithms_enabled()
    a, b = runs
    assert a.losses == b.losses
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
