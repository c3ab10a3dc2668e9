"""The model proxy of the benchmarks and the report: one definition (``csattn.report.model.proxy_config``), and
``benchmarks/configs/v4_flash_proxy.json`` (what ``csattn train --config-json`` takes) is its config.json."""

import json
import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig
from csattn.models.deepseek_v4.flops import _sum_div, _sum_min, model_flops
from csattn.report.model import proxy_config, proxy_lengths

JSON = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs", "v4_flash_proxy.json")


def test_proxy_json_is_the_proxy_config():
    with open(JSON) as f:
        on_disk = json.load(f)
    assert on_disk == json.loads(json.dumps(proxy_config().to_hf_dict()))
    cfg = DeepseekV4ModelConfig.from_hf(on_disk)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - 1.64) < 0.01  # the 1.64 B


def test_proxy_lengths_and_flops():
    assert proxy_lengths(16384) == [3996, 4196, 8192] and proxy_lengths(16384, True) == [16384]
    f = model_flops(proxy_config(), [0, 3996, 8192, 16384])
    assert abs((f["fwd"] + f["bwd"]) / 16384 / 1e9 - 6.14) < 0.01  # GFLOP per token, BENCHMARKS.md
    assert f["bwd"] > 2 * f["fwd"]  # attention's backward counts 2.5x


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 5000), st.integers(1, 300), st.sampled_from([1, 2, 4, 16, 128]), st.integers(1, 700))
def test_flop_key_counts_equal_the_per_row_sums(length, window, ratio, cap):
    """layer_flops' closed forms (no per-row tensors on the training loop's host path) against the row sums."""
    rows = torch.arange(1, length + 1, dtype=torch.float64)
    assert _sum_min(length, window) == float(rows.clamp(max=window).sum())
    assert _sum_div(length, ratio) == float((rows // ratio).sum())
    assert _sum_div(length, ratio, cap) == float((rows // ratio).clamp(max=cap).sum())
