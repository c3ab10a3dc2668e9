"""The fixed-point helpers of deterministic mode (csattn/ops/fixed_point.py) and how the flag reaches the kernels'
configs (AttentionConfig, DeepseekV4ModelConfig), and csattn.deterministic_mode for torch's own ops."""

import math

import pytest
import torch

from csattn.ops.fixed_point import abs_max, fixed_point_scale, from_fixed_point


def test_scale_is_power_of_two_within_headroom():
    for bound in (1e-30, 3.7e-5, 1.0, 12345.0, 2.0**70):
        s = fixed_point_scale(torch.tensor(bound))
        e = math.log2(float(s[0]))
        assert e == int(e) and float(s[0]) * float(s[1]) == 1.0 and float(s[2]) == 0.0
        assert bound * float(s[0]) <= 2.0**60 or e == 120
    assert float(fixed_point_scale(torch.tensor(0.0))[0]) == 2.0**120  # nothing to sum: any scale
    assert math.isnan(float(fixed_point_scale(torch.tensor(float("inf")))[2]))
    assert math.isnan(float(fixed_point_scale(torch.tensor(float("nan")))[2]))


def test_round_trip_and_order_independence():
    """Sums of rounded terms in two orders are the same integers; back in floats they are close to the fp64 sum."""
    gen = torch.Generator().manual_seed(0)
    terms = torch.randn(1000, 8, generator=gen, dtype=torch.float64) * torch.logspace(-6, 2, 8, dtype=torch.float64)
    bound = terms.abs().sum(0).max()
    s = fixed_point_scale(bound)
    ints = torch.floor(terms.float() * s[0] + 0.5).to(torch.int64)
    a, b = ints.sum(0), ints.flip(0).sum(0)
    assert torch.equal(a, b)
    got = from_fixed_point(a, s)
    assert torch.allclose(got.double(), terms.float().double().sum(0), rtol=1e-6, atol=float(bound) * 2**-40)
    out = torch.ones(8)
    from_fixed_point(a, s, out=out, accumulate=True)
    assert torch.equal(out, 1 + got)
    assert torch.isnan(from_fixed_point(a, fixed_point_scale(torch.tensor(float("inf"))))).all()


def test_abs_max():
    assert float(abs_max(torch.tensor([-3.0, 2.0]))) == 3.0
    assert float(abs_max(torch.zeros(0, 4))) == 0.0
    assert abs_max(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.float32


def test_flag_reaches_kernel_configs():
    from csattn import AttentionConfig
    from csattn.models.deepseek_v4.config import DeepseekV4ModelConfig
    from csattn.ops.sparse_attn import SparseAttnConfig

    assert AttentionConfig().sparse_attn_kernel is None  # the default path is untouched
    cfg = AttentionConfig(deterministic=True, sparse_attn_kernel="bk_dkv=32")
    assert cfg.sparse_attn_kernel == SparseAttnConfig(bk_dkv=32, deterministic=True)
    assert cfg.indexer_loss_kernel.deterministic is True
    model = DeepseekV4ModelConfig(num_hidden_layers=2, deterministic=True)
    assert all(model.attention_config(i).sparse_attn_kernel.deterministic is True for i in range(2))
    assert "deterministic" not in model.to_hf_dict() and model.training_dict()["deterministic"] is True
    assert SparseAttnConfig.parse("deterministic=1").deterministic is True
    assert SparseAttnConfig(deterministic=True).spec() == "deterministic=1"
    with pytest.raises(ValueError, match="deterministic is a flag"):
        SparseAttnConfig.parse("deterministic=2")
    # one road: a kernel config does not ask for it behind the layer's flag
    for name in ("sparse_attn_kernel", "indexer_loss_kernel"):
        with pytest.raises(ValueError, match=f"{name} asks for deterministic=1: set AttentionConfig.deterministic"):
            AttentionConfig(**{name: "deterministic=1"})


def test_deterministic_mode(monkeypatch):
    """``deterministic_mode`` turns torch's deterministic mode on for the block without its NaN fill of new
    tensors, sets cuBLAS's workspace, and gives every setting back after the block."""
    import os

    from csattn import deterministic_mode

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    fill = torch.utils.deterministic
    before = (torch.are_deterministic_algorithms_enabled(), fill.fill_uninitialized_memory,
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    with deterministic_mode():
        assert torch.are_deterministic_algorithms_enabled()
        assert not fill.fill_uninitialized_memory and torch.backends.cudnn.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert (torch.are_deterministic_algorithms_enabled(), fill.fill_uninitialized_memory,
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == before


@pytest.mark.parametrize("layer_type", ["csa", "hca"])
def test_layer_runs_under_torch_deterministic_mode(layer_type):
    """The layer's torch ops (reference backend, CPU) raise nothing under ``csattn.deterministic_mode`` (torch's
    use_deterministic_algorithms) and give the same bits twice."""
    from csattn import PackedSeqs, deterministic_mode
    from tests.helpers import layer_step, random_layer, tiny_config

    with deterministic_mode():
        layer = random_layer(tiny_config(layer_type, backend="reference", deterministic=True), dtype=torch.float32)
        gen = torch.Generator().manual_seed(1)
        x, dy = torch.randn(24, 32, generator=gen), torch.randn(24, 32, generator=gen)
        packed = PackedSeqs.from_lengths([13, 7], [16, 8])
        runs = [layer_step(layer, x, dy, packed=packed)[0] for _ in range(2)]
    for name, g in runs[0].items():
        assert torch.equal(g, runs[1][name]), name
