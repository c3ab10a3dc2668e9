"""The model under ``torch.autocast`` (CPU bf16 here; the CUDA bf16 / fp16 paths are the same code): every
``recompute`` choice gives, bit for bit, the loss and gradients of ``recompute="none"`` under autocast (each
recomputation runs with the forward's dtypes), the master weights stay fp32 with fp32 gradients, and the loss is
the fp32 model's within bf16 rounding. Before, the attention's output projection failed on autocast's operands."""

import pytest
import torch

from csattn import PackedSeqs
from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM
from csattn.models.deepseek_v4.model import future_tokens
from csattn.train.config import tiny_model_config


def _batch():
    packed = PackedSeqs.from_lengths([37, 1, 50], padded_lengths=[40, 4, 52])
    ids = torch.randint(0, 64, (packed.num_rows,), generator=torch.Generator().manual_seed(1))
    return ids, packed, future_tokens(ids, packed, 2)


def _step(autocast: bool, **config):
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(tiny_model_config(64, num_nextn_predict_layers=1, **config))
    ids, packed, labels = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, packed=packed, labels=labels[0], mtp_labels=labels[1:], return_logits=False)
    out.loss.backward()
    return out, model


@pytest.fixture(scope="module")
def reference():
    return _step(True, recompute="none")


@pytest.mark.parametrize("config", [
    dict(recompute="mhc"), dict(recompute="moe"), dict(recompute="block"), dict(recompute="full"),
    dict(recompute="block", offload_block_inputs=True),
], ids=["mhc", "moe", "block", "full", "block_offload"])
def test_every_recompute_choice_equals_none_under_autocast(reference, config):
    ref_out, ref = reference
    out, model = _step(True, **config)
    assert torch.equal(out.loss, ref_out.loss)
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(q.grad, p.grad), name


def test_autocast_keeps_fp32_masters_and_the_fp32_loss(reference):
    out, model = reference
    fp32_out, _ = _step(False, recompute="none")
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, fp32_out.loss, rtol=1e-2, atol=0)
    assert out.indexer_loss is not None and torch.isfinite(out.indexer_loss)
    grads = 0
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        if p.grad is not None:
            assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name
            grads += 1
    assert grads > 100


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_autocast_block_recompute_and_fp32_loss(dtype):
    """On CUDA (Triton kernels, grouped GEMMs, fused mHC) under autocast: block recompute gives the loss of no
    recompute bit for bit (the forward is deterministic) and gradients to the order of the backward's fp32
    atomics, and the loss is the fp32 model's within the dtype's rounding."""
    from tests.helpers import rel_err

    ids, packed, labels = (t.cuda() if isinstance(t, torch.Tensor) else t for t in _batch())
    packed = PackedSeqs.from_lengths([37, 1, 50], padded_lengths=[40, 4, 52], device="cuda")
    runs = []
    for recompute, autocast in (("none", True), ("block", True), ("none", False)):
        torch.manual_seed(0)
        model = DeepseekV4ForCausalLM(tiny_model_config(64, num_nextn_predict_layers=1, recompute=recompute)).cuda()
        with torch.autocast("cuda", dtype=dtype, enabled=autocast):
            out = model(ids, packed=packed, labels=labels[0], mtp_labels=labels[1:], return_logits=False)
        out.loss.backward()
        runs.append((out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (none, g_none), (block, g_block), (fp32, _) = runs
    assert torch.equal(none, block)
    assert g_none.keys() == g_block.keys() and len(g_none) > 100
    for name in g_none:
        assert g_none[name].dtype == torch.float32 and torch.isfinite(g_none[name]).all(), name
        assert rel_err(g_block[name], g_none[name]) <= 1e-2, name
    torch.testing.assert_close(none, fp32, rtol=1e-2, atol=0)
