"""The planner (``csattn plan``): parameter counts, per-rank sharding, errors naming the flag, the CLI (CPU, fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from csattn.models.deepseek_v4 import DeepseekV4ModelConfig
from csattn.parallel.mesh import ParallelDims
from csattn.parallel.plan import count_params, plan

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def _load(name: str, **overrides) -> DeepseekV4ModelConfig:
    return DeepseekV4ModelConfig.from_hf(json.loads((CONFIGS / name).read_text()), **overrides)


def test_v4_flash_parameter_count():
    c = _load("v4_flash.json")
    decoder = count_params(_load("v4_flash.json", num_nextn_predict_layers=0)).total
    assert abs(decoder / 284e9 - 1) < 0.02, decoder  # the published 284 B counts the decoder
    assert count_params(c).total > decoder  # plus the MTP block
    assert abs(count_params(_load("v4_pro.json")).total / 1.6e12 - 1) < 0.02


def test_count_matches_the_model_on_meta():
    torch = pytest.importorskip("torch")
    from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM

    c = _load("v4_flash_proxy.json", num_nextn_predict_layers=1)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(c)
    assert count_params(c).total == sum(p.numel() for p in model.parameters())


def test_per_rank_parameters_scale_with_the_shards():
    c = _load("v4_flash.json")
    pc = count_params(c)
    for gpus, ep in ((64, 1), (64, 8), (128, 8), (128, 32)):
        p = plan(c, ParallelDims(ep=ep, world=gpus), 4096, recompute="full")
        dims = ParallelDims(ep=ep, world=gpus).resolve()
        assert p.memory["parameters"] == pytest.approx(4.0 * pc.dense / dims.fsdp
                                                       + 4.0 * pc.experts / (dims.ep * dims.efsdp))
        assert p.memory["optimizer"] == pytest.approx(2 * p.memory["parameters"])
    a = plan(c, ParallelDims(world=64), 4096).memory["parameters"]
    b = plan(c, ParallelDims(world=128), 4096).memory["parameters"]
    assert a == pytest.approx(2 * b)


def test_bad_meshes_name_the_flag():
    c = _load("v4_flash.json")
    with pytest.raises(ValueError, match="--dp-shard"):
        plan(c, ParallelDims(dp_shard=3, cp=2, world=8), 4096)
    with pytest.raises(ValueError, match="--ep"):
        plan(c, ParallelDims(dp_shard=12, ep=12, world=12), 4096)  # 12 does not divide 256 experts
    with pytest.raises(ValueError, match="--ep"):
        plan(c, ParallelDims(dp_shard=4, ep=8, world=4), 4096)


def test_cli_prints_the_fit_and_the_peak(capsys):
    from csattn.cli import main

    proxy = str(CONFIGS / "v4_flash_proxy.json")
    assert main(["plan", "--config", proxy, "--gpus", "1", "--seq-len", "16384", "--recompute", "none"]) == 0
    out = capsys.readouterr().out
    assert "fit: yes" in out and "peak (predicted):" in out
    assert main(["plan", "--config", str(CONFIGS / "v4_flash.json"), "--gpus", "8", "--seq-len", "4096",
                 "--ep", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and data["dims"]["ep"] == 8
    assert main(["plan", "--config", proxy, "--gpus", "8", "--dp-shard", "3", "--cp", "2"]) == 2
