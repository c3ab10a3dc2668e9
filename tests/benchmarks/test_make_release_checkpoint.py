"""``benchmarks.make_release_checkpoint``: a random checkpoint in the release's format for a config, shrunk."""

import json

import torch

from benchmarks.make_release_checkpoint import main
from csattn.models.deepseek_v4 import load_pretrained
from csattn.models.deepseek_v4.checkpoint import read_config
from tests.models.model_utils import disk, tiny_config_dict


def test_make_release_checkpoint_tool(tmp_path, capsys):
    """The benchmark tool writes a shrunk geometry in the release's format, one shard per unit, that loads FP8-held
    and dequantized alike."""
    raw = tiny_config_dict("flash", mtp=1)
    raw.update(hidden_size=64, moe_intermediate_size=128)
    (tmp_path / "c.json").write_text(json.dumps(raw))
    main(["--config", str(tmp_path / "c.json"), "--out", str(tmp_path / "out"), "--layers", "3", "--experts", "2",
          "--mtp", "0"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["shards"] == 4  # top + 3 layers
    saved = read_config(str(tmp_path / "out"))
    assert saved["quantization_config"]["scale_fmt"] == "ue8m0" and saved["expert_dtype"] == "fp4"
    model = load_pretrained(str(tmp_path / "out"), base_precision="fp8")
    assert len(model.model.layers) == 3 and model.model.layers[2].mlp.experts.gate_up_proj.shape == (2, 256, 64)
    assert disk(str(tmp_path / "out"), "layers.0.attn.wq_b.scale").dtype == torch.float8_e8m0fnu
