"""``csattn train`` with LoRA and frozen groups: only the adapters (or the trained groups) change, a resumed run
equals the uninterrupted one bit for bit, each checkpoint holds ``adapter/`` and the final one the merged model,
another choice on resume and conflicting flags are refused; gloo meshes (dp_shard x ep, with cp) equal one
process in fp64."""

from __future__ import annotations

import json
import os

import pytest
import torch

from csattn.cli import main
from csattn.finetune.lora import lora_modules
from csattn.finetune.setup import Finetune
from csattn.models.deepseek_v4.checkpoint import load_pretrained
from csattn.packing import PackedSeqs
from csattn.train.build import build_model, build_model_config, setup_distributed
from csattn.train.demo import run_spawned
from csattn.train.run import TrainConfig, train

SMALL = dict(seq_len=64, device="cpu", progress=False, warmup_steps=2)
LORA = dict(lora_rank=4, lora_alpha=8.0)


def _initial(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The weights a run of ``cfg`` starts from."""
    meshes, device = setup_distributed(cfg)
    model = build_model(cfg, build_model_config(cfg), meshes, device, Finetune.from_options(cfg))[0]
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_lora_run_trains_adapters_only_resumes_exactly_and_exports(tmp_path, assert_close):
    out = str(tmp_path / "run")
    cfg = TrainConfig(steps=3, output=out, save_every=2, **LORA, **SMALL)
    before = _initial(cfg)
    full = train(cfg)
    after = full.model.state_dict()
    assert len(lora_modules(full.model)) > 0
    for name, t in after.items():
        if ".lora_B" in name:
            assert not torch.equal(t, before[name]), name
        elif ".lora_" not in name:  # the base, the router's balance bias included (a frozen router)
            assert torch.equal(t, before[name]), name
    ckpt = os.path.join(out, "checkpoint-000002")
    assert sorted(os.listdir(os.path.join(ckpt, "adapter"))) == ["adapter_config.json", "adapter_model.safetensors"]
    resumed = train(TrainConfig(steps=3, output=out, resume=ckpt, **LORA, **SMALL))
    assert resumed.losses == full.losses[2:]  # bitwise
    for name, t in resumed.model.state_dict().items():
        assert torch.equal(t, after[name]), name
    # the final checkpoint's HF export is the merged model: the LoRA model's logits without any LoRA
    merged = load_pretrained(os.path.join(out, "checkpoint-000003"))
    assert not any(".lora_" in n for n in merged.state_dict())
    ids = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(0))
    packed = PackedSeqs.from_lengths([48])
    with torch.no_grad():
        want = resumed.model(ids, packed=packed).logits
        assert_close(merged(ids, packed=packed).logits, want, 1e-5, "merged export")


def test_resume_with_other_choices_is_refused(tmp_path):
    out = str(tmp_path / "run")
    train(TrainConfig(steps=1, output=out, **LORA, **SMALL))
    for other, flag in [({"lora_rank": 8}, "--lora-rank 8 (checkpoint: 4)"),
                        ({"lora_targets": "attention"}, "--lora-targets 'attention' (checkpoint: None)"),
                        ({"lora_rank": 0, "freeze_groups": "experts"}, "--lora-rank 0")]:
        with pytest.raises(ValueError, match="other fine-tuning choices") as err:
            train(TrainConfig(steps=2, output=out, resume="auto", **{**LORA, **other}, **SMALL))
        assert flag in str(err.value) and "\n" not in str(err.value)


def test_frozen_experts_full_training():
    cfg = TrainConfig(steps=2, freeze_groups="experts,router", **SMALL)
    before = _initial(cfg)
    result = train(cfg)
    after = result.model.state_dict()
    for name, t in after.items():
        frozen = ".mlp.experts." in name or ".mlp.gate." in name
        if t.is_floating_point() and "inv_freq" not in name:
            assert torch.equal(t, before[name]) == frozen, name
    assert not any(p.requires_grad for n, p in result.model.named_parameters() if ".mlp.experts." in n)


def test_cli_flags_and_conflicts(tmp_path, capsys):
    base = ["train", "--steps", "1", "--seq-len", "32", "--no-progress", "--device", "cpu"]
    assert main(base + ["--train", "attention", "--freeze", "experts"]) == 2
    assert "--train and --freeze both given" in capsys.readouterr().err
    assert main(base + ["--lora-rank", "4", "--lora-dropout", "0.1"]) == 2
    assert "--lora-dropout 0.1" in capsys.readouterr().err
    assert main(base + ["--lora-rank", "4", "--lora-targets", "router"]) == 2
    assert "--lora-targets: unknown group(s) 'router'" in capsys.readouterr().err
    assert main(base + ["--lora-rank", "4", "--train", "attention", "--lora-targets", "indexer"]) == 2
    assert "--train attention with --lora-targets indexer" in capsys.readouterr().err
    out = str(tmp_path / "cli")
    assert main(base + ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "attention,compressor",
                        "--train", "router", "--output", out]) == 0
    adapter = os.path.join(out, "checkpoint-000001", "adapter")
    assert os.path.isfile(os.path.join(adapter, "adapter_model.safetensors"))
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert "model.layers.0.mlp.gate" in json.load(f)["modules_to_save"]


@pytest.mark.slow
def test_mesh_checkpoint_resumes_in_one_process(tmp_path):
    """A checkpoint written on dp_shard 2 x ep 2 (adapters of the routed experts split over ep, stored whole by DCP)
    resumes in one process and continues the uninterrupted one-process run (fp64, 1e-10)."""
    base = dict(steps=2, seq_len=64, device="cpu", progress=False, warmup_steps=1, pad_multiple=4, dtype="float64",
                batch_seqs=2, export_hf="never", **LORA)
    one = train(TrainConfig(**base))
    out = str(tmp_path / "mesh")
    run_spawned(2, TrainConfig(**{**base, "steps": 1}, dp_shard=2, ep=2, output=out))
    resumed = train(TrainConfig(**base, output=out, resume=os.path.join(out, "checkpoint-000001")))
    assert resumed.start_step == 1 and abs(resumed.losses[0] - one.losses[1]) <= 1e-10 * abs(one.losses[1])
    for k, v in one.model.state_dict().items():
        if ".lora_" in k:
            err = float((resumed.model.state_dict()[k] - v).norm() / v.norm().clamp_min(1e-30))
            assert err <= 1e-9, k


MESHES = [(2, dict(dp_shard=2, ep=2), {}),
          (2, dict(dp_shard=2, ep=2), {"lora_targets": "attention,shared_experts"}),
          (4, dict(dp_shard=2, cp=2, ep=2), {})]


@pytest.mark.slow
@pytest.mark.parametrize("world,mesh,extra", MESHES, ids=["dp2-ep2", "dp2-ep2-experts-frozen", "dp2-cp2-ep2"])
def test_mesh_equals_one_process_fp64(world, mesh, extra, tmp_path):
    """FSDP2 units mixing frozen bases and trainable adapters (and units wholly frozen: the experts without LoRA)
    reduce only the gradients that exist: the losses equal one process to 1e-10 and every adapter to 1e-9; the
    checkpoints' adapter files (experts gathered over ep) and merged exports agree too."""
    from safetensors.torch import load_file

    # two sequences per step in both runs (the mesh has two data replicas)
    base = dict(steps=2, seq_len=64, device="cpu", progress=False, warmup_steps=1, pad_multiple=4, dtype="float64",
                batch_seqs=2, **LORA, **extra)
    one = train(TrainConfig(**base, output=str(tmp_path / "one")))
    got = run_spawned(world, TrainConfig(**base, **mesh, output=str(tmp_path / "mesh")))
    ckpt = "checkpoint-000002"
    want_adapter = load_file(str(tmp_path / "one" / ckpt / "adapter" / "adapter_model.safetensors"))
    got_adapter = load_file(str(tmp_path / "mesh" / ckpt / "adapter" / "adapter_model.safetensors"))
    assert want_adapter.keys() == got_adapter.keys() and want_adapter
    for k, v in want_adapter.items():
        assert float((got_adapter[k] - v).norm() / v.norm().clamp_min(1e-30)) <= 1e-9, k
    want_merged = load_pretrained(str(tmp_path / "one" / ckpt)).state_dict()
    got_merged = load_pretrained(str(tmp_path / "mesh" / ckpt)).state_dict()
    for k, v in want_merged.items():
        if v.is_floating_point():
            assert float((got_merged[k].double() - v.double()).norm() / v.double().norm().clamp_min(1e-30)) <= 1e-9, k
    for a, b in zip(got["losses"], one.losses):
        assert abs(a - b) <= 1e-10 * abs(b)
    state = one.model.state_dict()
    for k, v in state.items():
        if v.is_floating_point():
            err = float((got["state"][k].double() - v).norm() / v.norm().clamp_min(1e-30))
            assert err <= 1e-9, k


def test_lora_on_an_hf_checkpoint_starts_from_its_loss(tmp_path):
    """--init-from with LoRA: the base weights are the checkpoint's and the first step's loss is the base model's
    bit for bit (B = 0), the adapters drawn after the import."""
    from tests.models.model_utils import tiny_model

    start = tiny_model("pro", seed=9, mtp=1)
    start.save_pretrained(str(tmp_path / "init"))
    common = dict(steps=2, init_from=str(tmp_path / "init"), **SMALL)
    plain = train(TrainConfig(**common))
    tuned = train(TrainConfig(**common, **LORA))
    assert tuned.losses[0] == plain.losses[0] and tuned.losses[1] != plain.losses[1]
    base = start.state_dict()
    for name, t in tuned.model.state_dict().items():
        if ".lora_" not in name:
            assert torch.equal(t, base[name]), name
