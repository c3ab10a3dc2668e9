"""``DeepseekV4ModelConfig.recompute``: every choice gives the same loss and gradients as ``none`` (fp64, the
redone forward is the same computation), and keeps less for the backward in the stated order."""

import pytest
import torch

from csattn import PackedSeqs
from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig
from csattn.models.deepseek_v4.model import future_tokens
from csattn.report.live_tensors import model_kept
from csattn.train.config import tiny_model_config


def _model(recompute: str, dtype=torch.float64, mtp: int = 1) -> DeepseekV4ForCausalLM:
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(tiny_model_config(64, recompute=recompute, num_nextn_predict_layers=mtp))
    return model.to_training_dtype(dtype)


def _batch():
    packed = PackedSeqs.from_lengths([37, 1, 50], padded_lengths=[40, 4, 52])
    ids = torch.randint(0, 64, (packed.num_rows,), generator=torch.Generator().manual_seed(1))
    labels = future_tokens(ids, packed, 2)
    return ids, packed, labels


@pytest.mark.parametrize("recompute", ["mhc", "moe", "block", "full"])
def test_recompute_changes_no_value(recompute):
    ids, packed, labels = _batch()
    ref, got = _model("none"), _model(recompute)
    outs = []
    for model in (ref, got):
        out = model(ids, packed=packed, labels=labels[0], mtp_labels=labels[1:], return_logits=False)
        out.loss.backward()
        outs.append(out)
    assert torch.equal(outs[0].loss, outs[1].loss)
    for (name, p), (_, q) in zip(ref.named_parameters(), got.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.slow  # five model runs
def test_recompute_keeps_less_in_order():
    ids, packed, labels = _batch()
    kept = {}
    for choice in ("none", "mhc", "moe", "block", "full"):
        model = _model(choice, torch.float32)
        by, loss = model_kept(model, lambda m=model: m(ids, packed=packed, labels=labels[0], mtp_labels=labels[1:],
                                                        return_logits=False).loss)
        kept[choice] = by
        loss.backward()
    total = {k: sum(v.values()) for k, v in kept.items()}
    assert total["block"] < total["mhc"] < total["none"] and total["moe"] < total["none"], total
    # full keeps what block keeps (the recompute inside a block changes only the backward's peak)
    assert total["full"] <= total["block"], total
    # mhc recompute: a site keeps only its outputs, post [T, n] and comb [T, n, n] (fp32) for the combine and the
    # normed sub-block input [T, D] (fp32 here), which the sub-block's own layers keep in any case
    n, rows, d = 4, packed.num_rows, model.config.hidden_size
    sites = {k: v for k, v in kept["mhc"].items() if k.endswith(("attn_hc", "ffn_hc"))}
    assert sites and all(v <= rows * (n + n * n + d) * 4 for v in sites.values()), sites
    # moe recompute: the MoE keeps (nearly) nothing
    moe = lambda by: sum(v for k, v in by.items() if k.endswith(".mlp"))
    assert moe(kept["moe"]) < moe(kept["none"]) / 4


@pytest.mark.parametrize("recompute", ["block", "full"])
def test_block_recompute_without_mtp_keeps_one_stream_set_per_boundary(recompute):
    """Without MTP blocks the first recomputed block starts from the embedding [T, D] and the last one ends with
    the hyper-head and final norm: the forward keeps the embedding, one stream set per inner boundary and the
    final hidden, and the loss and gradients are those of recompute none (fp64)."""
    ids, packed, labels = _batch()
    ref, got = _model("none", mtp=0), _model(recompute, mtp=0)
    losses = []
    for model in (ref, got):
        out = model(ids, packed=packed, labels=labels[0], return_logits=False)
        out.loss.backward()
        losses.append(out.loss)
    assert torch.equal(losses[0], losses[1])
    for (name, p), (_, q) in zip(ref.named_parameters(), got.named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-14, msg=name)
    model = _model(recompute, torch.float32, mtp=0)
    by, loss = model_kept(model, lambda: model(ids, packed=packed, labels=labels[0], return_logits=False).loss)
    loss.backward()
    c, rows = model.config, packed.num_rows
    # embedding [D] + (layers - 1) stream sets [n, D] + the final hidden [D], fp32; ids, labels and row flags
    bound = rows * 4 * (c.hidden_size * 2 + (c.num_hidden_layers - 1) * c.hc_mult * c.hidden_size) + rows * 64
    assert sum(by.values()) <= bound + 4096, (sum(by.values()), bound)


def test_config_recompute_choices():
    assert tiny_model_config(recompute="block").recompute == "block"
    with pytest.raises(ValueError, match="recompute must be one of"):
        tiny_model_config(recompute="all")
    d = tiny_model_config(recompute="moe").to_hf_dict()
    assert "recompute" not in d  # a training field: not in config.json
    assert DeepseekV4ModelConfig.from_hf({**d, "recompute": "mhc"}).recompute == "mhc"


@pytest.mark.parametrize("recompute,mtp", [("block", 0), ("full", 0), ("full", 1)],
                         ids=["block", "full", "full-mtp"])
def test_offloaded_block_inputs_change_no_value(recompute, mtp):
    """Block inputs kept in host memory until their recomputation (``offload_block_inputs``): the loss, the logged
    indexer loss and every gradient equal those of recompute none (fp64; the indexer loss trains, coeff 0.1; with an
    MTP block, which keeps torch's checkpoint, after offloaded decoder blocks)."""
    ids, packed, labels = _batch()
    outs, models = [], []
    for choice, offload in (("none", False), (recompute, True)):
        torch.manual_seed(0)
        model = DeepseekV4ForCausalLM(tiny_model_config(64, recompute=choice, num_nextn_predict_layers=mtp,
                                                        indexer_loss_coeff=0.1, offload_block_inputs=offload))
        model = model.to_training_dtype(torch.float64)
        out = model(ids, packed=packed, labels=labels[0], mtp_labels=labels[1:1 + mtp] if mtp else None,
                    return_logits=False)
        out.loss.backward()
        outs.append(out)
        models.append(model)
    assert torch.equal(outs[0].loss, outs[1].loss)
    assert outs[0].indexer_loss is not None and torch.equal(outs[0].indexer_loss, outs[1].indexer_loss)
    for (name, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_offload_needs_block_recompute():
    with pytest.raises(ValueError, match="offload_block_inputs .* needs recompute='block' or 'full'"):
        tiny_model_config(recompute="mhc", offload_block_inputs=True)
