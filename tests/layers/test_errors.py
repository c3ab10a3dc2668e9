"""Bad input gets a ValueError that names the argument."""

import pytest
import torch

from csattn import AttentionConfig, HybridAttention, PackedSeqs
from tests.helpers import random_layer, tiny_config


@pytest.fixture(scope="module")
def layer():
    return random_layer(tiny_config("csa"), dtype=torch.float32)


def _x(rows=10):
    return torch.randn(rows, 32)


@pytest.mark.parametrize(
    "cu,match",
    [
        (torch.tensor([0.0, 10.0]), "cu_seqlens_padded must be int32 or int64"),
        (torch.tensor([[0, 10]], dtype=torch.int32), "cu_seqlens_padded must be 1-D"),
        (torch.tensor([1, 10], dtype=torch.int32), "cu_seqlens_padded must start at 0"),
        (torch.tensor([0, 6, 4, 10], dtype=torch.int32), "cu_seqlens_padded must be non-decreasing"),
        (torch.tensor([0, 4, 9], dtype=torch.int32), r"cu_seqlens_padded\[-1\] = 9 must equal the number of rows"),
        (torch.tensor([0], dtype=torch.int32), "cu_seqlens_padded must have at least 2 entries"),
        ([0, 10], "cu_seqlens_padded must be a torch.Tensor"),
    ],
    ids=["float", "2d", "nonzero_start", "decreasing", "wrong_total", "too_short", "list"],
)
def test_malformed_cu_seqlens(layer, cu, match):
    with pytest.raises(ValueError, match=match):
        layer(_x(), packed=PackedSeqs(cu_seqlens_padded=cu))


def test_real_cu_seqlens_checked_too(layer):
    pad = torch.tensor([0, 5, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        layer(_x(), packed=PackedSeqs(cu_seqlens=torch.tensor([0, 4, 3], dtype=torch.int32), cu_seqlens_padded=pad))
    with pytest.raises(ValueError, match="shorter than its real length"):
        layer(_x(), packed=PackedSeqs(cu_seqlens=torch.tensor([0, 6, 9], dtype=torch.int32), cu_seqlens_padded=pad))
    with pytest.raises(ValueError, match="documents"):
        layer(_x(), packed=PackedSeqs(cu_seqlens=torch.tensor([0, 10], dtype=torch.int32), cu_seqlens_padded=pad))


def test_wrong_device(layer):
    cu = torch.tensor([0, 10], dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="cu_seqlens_padded is on meta"):
        layer(_x(), packed=PackedSeqs(cu_seqlens_padded=cu))


def test_packed_object_without_fields(layer):
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        layer(_x(), packed=object())


def test_hidden_size_mismatch(layer):
    with pytest.raises(ValueError, match="hidden_states has hidden size 31"):
        layer(torch.randn(10, 31))
    with pytest.raises(ValueError, match="hidden_states must be floating point"):
        layer(torch.ones(10, 32, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, S, D\] or \[T, D\]"):
        layer(torch.randn(10))


def test_checkpoint_head_dims_not_matching(layer):
    sd = {k: v.clone() for k, v in layer.state_dict().items()}
    sd["q_b_proj.weight"] = torch.randn(2 * 24, 16)
    with pytest.raises(ValueError, match=r"q_b_proj.weight: checkpoint shape \(48, 16\)"):
        layer.load_hf_state_dict(sd)
    sd = {k: v.clone() for k, v in layer.state_dict().items()}
    del sd["sinks"]
    with pytest.raises(ValueError, match="missing \\['sinks'\\]"):
        layer.load_hf_state_dict(sd)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(index_topk=0), "index_topk must be >= 1"),
        (dict(compress_ratio=0), "compress_ratio must be a positive int"),
        (dict(compress_ratio=2.5), "compress_ratio must be a positive int"),
        (dict(rope_head_dim=7), "rope_head_dim must be even"),
        (dict(rope_head_dim=64), "rope_head_dim must be even and <= head_dim"),
        (dict(o_groups=3), "o_groups"),
        (dict(num_heads=0), "num_heads must be >= 1"),
        (dict(indexer_loss_type="mse"), "indexer_loss_type"),
        # non-integer sizes are refused here, not by a TypeError deep inside the indexer
        (dict(index_topk=1.5), r"index_topk must be an int, got 1.5 \(float\)"),
        (dict(index_topk=4.0), r"index_topk must be an int, got 4.0"),
        (dict(index_n_heads=2.5), "index_n_heads must be an int"),
        (dict(sliding_window=8.5), "sliding_window must be an int"),
        (dict(num_heads=True), "num_heads must be an int, got True"),
        (dict(workspace_bytes=1e9), "workspace_bytes must be an int"),
        (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number > 0"),
        (dict(indexer_loss_coeff=-0.1), "indexer_loss_coeff must be a finite number >= 0"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_config("csa", **kwargs)


def test_unknown_layer_type():
    with pytest.raises(ValueError, match="layer_type must be one of"):
        AttentionConfig(layer_type="dense")


def test_unknown_layer_type_from_hf():
    from types import SimpleNamespace

    hf = SimpleNamespace(layer_types=["full_attention"])
    with pytest.raises(ValueError, match="unknown layer type 'full_attention'"):
        AttentionConfig.from_hf(hf, 0)


def test_batch_input_with_packed_is_rejected(layer):
    with pytest.raises(ValueError, match="packed= is for"):
        layer(torch.randn(2, 5, 32), packed=PackedSeqs.from_lengths([5, 5]))


def test_module_constructs_with_defaults():
    assert isinstance(HybridAttention(tiny_config("hca")), torch.nn.Module)
