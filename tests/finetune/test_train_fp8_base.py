"""``csattn train --base-precision fp8 / w8a16`` on a synthetic release checkpoint (FP8 dense, MXFP4 experts): the
routed experts stay e4m3 (no full-precision copy), the losses equal the dequantized base's (the CPU's FP8 ops run
their references: the weight dequantized exactly), the adapters of every layer learn, a resumed run equals the
uninterrupted one bit for bit, a gloo dp_shard 2 x ep 2 mesh equals one process in fp64, and what cannot work is
refused in one line."""

from __future__ import annotations

import os

import pytest
import torch

from csattn.cli import main
from csattn.models.deepseek_v4.release import write_release_checkpoint
from csattn.train.build import check_launch_options
from csattn.train.demo import run_spawned
from csattn.train.run import TrainConfig, train
from tests.models.test_fp8_model import tiny_config

LORA = dict(lora_rank=4, lora_alpha=8.0)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    path = tmp_path_factory.mktemp("release")
    write_release_checkpoint(tiny_config(), str(path), seed=3)
    return str(path)


def _base(release: str, **kw) -> dict:
    return dict(steps=3, seq_len=64, device="cpu", progress=False, warmup_steps=1, init_from=release,
                export_hf="never", **LORA, **kw)


@pytest.mark.parametrize("precision", ["fp8", "w8a16"])
def test_fp8_base_equals_bf16_base_trains_every_layer_and_resumes(release, precision, tmp_path):
    out = str(tmp_path / "run")
    held = train(TrainConfig(**_base(release), base_precision=precision, output=out, save_every=1))
    plain = train(TrainConfig(**_base(release)))
    torch.testing.assert_close(torch.tensor(held.losses), torch.tensor(plain.losses), rtol=1e-5, atol=0)
    experts = {n: p for n, p in held.model.named_parameters() if ".mlp.experts." in n and ".lora_" not in n}
    assert experts and all(p.dtype == torch.float8_e4m3fn and not p.requires_grad for p in experts.values())
    assert not any(b.dtype in (torch.float32, torch.bfloat16) and b.dim() == 3 and ".mlp.experts." in n
                   for n, b in held.model.named_buffers() if not n.endswith("_scale_inv"))
    # B starts at zero: a nonzero B after training means its gradient arrived, through the FP8 experts above it
    state = held.model.state_dict()
    for layer in range(4):
        for name in (f"model.layers.{layer}.self_attn.q_b_proj.lora_B",
                     f"model.layers.{layer}.mlp.experts.lora_B_gate_up"):
            assert state[name].abs().sum() > 0, name
    resumed = train(TrainConfig(**_base(release), base_precision=precision, output=out,
                                resume=os.path.join(out, "checkpoint-000001")))
    assert resumed.losses == held.losses[1:]  # bitwise
    for name, t in resumed.model.state_dict().items():
        assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t,
                           state[name].view(torch.uint8) if t.element_size() == 1 else state[name]), name


def test_fp8_linears_hold_the_frozen_dense_layers_without_lora(release):
    cfg = TrainConfig(**{**_base(release), "steps": 1, "lora_targets": "attention"}, base_precision="fp8",
                      fp8_linears=True)
    model = train(cfg).model
    params = dict(model.named_parameters())
    # the shared experts (frozen, no LoRA) are held in FP8; the adapted attention keeps its weight in the compute
    # dtype
    assert params["model.layers.1.mlp.shared_experts.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert params["model.layers.1.self_attn.q_b_proj.weight"].dtype == torch.float32
    # the MTP block's shared experts too; its e_proj / h_proj (group head: not among the planner's FP8 groups) not
    assert params["mtp.0.mlp.shared_experts.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert params["mtp.0.e_proj.weight"].dtype == torch.float32


def test_merged_export_of_an_fp8_base_is_the_trained_model_in_bf16(release, tmp_path):
    """``--export-hf`` with LoRA on FP8-held experts and dense linears: every FP8 weight written dequantized to bf16
    (with its delta where adapted), no scales and no ``quantization_config``; the export's logits are the trained
    model's up to that rounding (2^-9 relative per weight)."""
    import json

    from csattn.models.deepseek_v4 import load_pretrained

    out = str(tmp_path / "run")
    cfg = TrainConfig(**{**_base(release), "steps": 2, "export_hf": "final"}, base_precision="fp8", fp8_linears=True,
                      lora_targets="attention,experts", output=out, save_every=2)
    held = train(cfg).model
    path = os.path.join(out, "checkpoint-000002")
    assert "quantization_config" not in json.load(open(os.path.join(path, "config.json")))
    merged = load_pretrained(path, dtype=torch.float32)
    assert not any(n.endswith("_scale_inv") for n in merged.state_dict())
    ids = torch.randint(0, held.config.vocab_size, (48,), generator=torch.Generator().manual_seed(1))
    from csattn.packing import PackedSeqs

    packed = PackedSeqs.from_lengths([48])
    with torch.no_grad():
        want, got = held(ids, packed=packed).logits, merged(ids, packed=packed).logits
    err = float((got - want).norm() / want.norm())
    assert err < 2e-2, err  # the FP8 codes taken as values (no scales) give logits off by O(1)


def test_refusals_are_one_line(release, tmp_path, capsys, monkeypatch):
    base = ["train", "--steps", "1", "--seq-len", "32", "--no-progress", "--device", "cpu"]
    cases = [(["--base-precision", "fp8", "--lora-rank", "4"], "pass --init-from DIR"),
             (["--base-precision", "fp8", "--init-from", release], "every group trains"),
             (["--base-precision", "w8a16", "--init-from", release, "--lora-rank", "4", "--lora-targets", "attention",
               "--train", "experts"],
              "--train includes experts"),
             (["--fp8-linears", "--init-from", release, "--lora-rank", "4"], "--fp8-linears applies to FP8-held")]
    for extra, want in cases:
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("csattn train: error:") and want in err and "\n" not in err, err
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"--ep 1: routed experts frozen in FP8 .* use --ep 2"):
        check_launch_options(TrainConfig(**_base(release), base_precision="fp8", dp_shard=2, ep=1))
    monkeypatch.delenv("WORLD_SIZE")
    out = str(tmp_path / "run")
    train(TrainConfig(**{**_base(release), "steps": 1}, base_precision="fp8", output=out))
    with pytest.raises(ValueError, match="--base-precision 'bf16' \\(checkpoint: 'fp8'\\)"):
        train(TrainConfig(**{**_base(release), "steps": 2}, output=out, resume="auto"))


@pytest.mark.slow
def test_mesh_equals_one_process_fp64(release):
    """dp_shard 2 x ep 2 on gloo: each rank holds and reads its own FP8 experts; the losses equal one process's to
    1e-10 and the adapters to 1e-9 (fp64)."""
    base = dict(_base(release), steps=2, pad_multiple=4, dtype="float64", batch_seqs=2, base_precision="fp8")
    one = train(TrainConfig(**base))
    got = run_spawned(2, TrainConfig(**base, dp_shard=2, ep=2))
    for a, b in zip(got["losses"], one.losses, strict=True):
        assert abs(a - b) <= 1e-10 * abs(b)
    for k, v in one.model.state_dict().items():
        if ".lora_" in k:
            err = float((got["state"][k].double() - v).norm() / v.norm().clamp_min(1e-30))
            assert err <= 1e-9, k
