"""The layer equals Hugging Face's DeepseekV4Attention (transformers 5.23, eager) on the same weights."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention  # noqa: E402

from csattn import AttentionConfig, HybridAttention  # noqa: E402
from tests.hf_ref import hf_attention_forward, randomize_, tiny_hf_config  # noqa: E402

# lengths: below r (4), not a multiple of r, longer than W (8), and long enough that more entries are
# visible than top-k (3); 300 > 128 exercises a real HCA ratio too.
CASES = [
    ("sliding", 3, {}), ("sliding", 37, {}),
    ("csa", 3, {}), ("csa", 13, {}), ("csa", 37, {}), ("csa", 61, {"yarn": False}),
    ("hca", 5, {}), ("hca", 37, {}), ("hca", 300, {"hca_ratio": 128}),
]
TOL = {torch.float64: 1e-6, torch.float32: 1e-5}


def _run(layer_type, seqlen, kwargs, dtype, seed=0):
    hf_cfg, idx = tiny_hf_config(layer_type, **kwargs)
    hf = DeepseekV4Attention(hf_cfg, idx).to(dtype)
    randomize_(hf, seed + 1)
    ours = HybridAttention(AttentionConfig.from_hf(hf_cfg, idx)).to(dtype)
    ours.load_hf_state_dict(hf.state_dict())
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, seqlen, hf_cfg.hidden_size, generator=g, dtype=torch.float64).to(dtype)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf = hf_attention_forward(hf, hf_cfg, x_hf)
    y_ours = ours(x_ours)
    dy = torch.randn(y_hf.shape, generator=g, dtype=torch.float64).to(dtype)
    (y_hf * dy).sum().backward()
    (y_ours * dy).sum().backward()
    return hf, ours, (x_hf, y_hf), (x_ours, y_ours)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("layer_type,seqlen,kwargs", CASES,
                         ids=[f"{t}-S{s}{'-' + '-'.join(k) if k else ''}" for t, s, k in CASES])
def test_matches_hf(layer_type, seqlen, kwargs, dtype, assert_close):
    hf, ours, (x_hf, y_hf), (x_ours, y_ours) = _run(layer_type, seqlen, kwargs, dtype)
    tol = TOL[dtype]
    assert_close(y_ours, y_hf, tol, "output")
    assert_close(x_ours.grad, x_hf.grad, tol, "input grad")
    hf_params = dict(hf.named_parameters())
    assert set(hf_params) == {n for n, _ in ours.named_parameters()}
    checked = 0
    for name, p in ours.named_parameters():
        ref = hf_params[name].grad
        if ref is None:
            # HF gives no gradient to the indexer (ours: the coeff-0 indexer loss makes it exist and be 0)
            # nor, for sequences shorter than r, to the compressor
            assert ".indexer." in name or (name.startswith("compressor.") and seqlen < ours.config.compress_ratio), name
            assert p.grad is None or torch.count_nonzero(p.grad) == 0, name
            if ".indexer." in name:
                assert p.grad is not None, name
            continue
        assert_close(p.grad, ref, tol, f"grad {name}")
        checked += 1
    assert checked >= 8  # q_a, q_a_norm, q_b, kv, kv_norm, o_a, o_b, sinks (+ compressor)


def test_sinks_and_position_bias_matter():
    """Guard against a parity test that passes trivially: changing the sink changes the output."""
    hf, ours, _, (x, y) = _run("csa", 13, {}, torch.float64)
    with torch.no_grad():
        ours.sinks.add_(1.0)
        assert (ours(x.detach()) - y.detach()).abs().max() > 1e-3
        ours.sinks.sub_(1.0)
        ours.compressor.position_bias.add_(torch.randn_like(ours.compressor.position_bias))
        assert (ours(x.detach()) - y.detach()).abs().max() > 1e-6


def test_config_from_hf_yarn():
    hf_cfg, idx = tiny_hf_config("csa")
    cfg = AttentionConfig.from_hf(hf_cfg, idx)
    assert cfg.layer_type == "csa" and cfg.compress_ratio == 4 and cfg.rope_scaling is not None
    assert cfg.rope_scaling.factor == 4.0 and cfg.rope_head_dim == 8
    cfg_w = AttentionConfig.from_hf(hf_cfg, 0)
    assert cfg_w.layer_type == "sliding" and cfg_w.rope_scaling is None and cfg_w.rope_theta == 10000.0
