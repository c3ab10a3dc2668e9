"""``DeepseekV4ModelConfig.recompute``: every choice gives the same loss and gradients as ``none`` (fp64, the
redone forward is the same computation), and keeps less for the backward in the stated order."""

import pytest
import torch

from benchmarks.live_tensors import model_kept
from csattn import PackedSeqs
from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig
from csattn.models.deepseek_v4.model import future_tokens
from csattn.train.loop import tiny_model_config

from .test_model_utils import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(recompute: str, dtype=torch.float64) -> DeepseekV4ForCausalLM:
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(tiny_model_config(64, recompute=recompute))
    return model.to_training_dtype(dtype)


def _batch():
    packed = PackedSeqs.from_lengths([37, 1, 50], padded_lengths=[40, 4, 52])
    ids = torch.randint(0, 64, (packed.num_rows,), generator=torch.Generator().manual_seed(1))
    labels = future_tokens(ids, packed, 2)
    return ids, packed, labels


@pytest.mark.parametrize("recompute", ["mhc", "moe", "block"])
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


def test_recompute_keeps_less_in_order():
    ids, packed, labels = _batch()
    kept = {}
    for choice in ("none", "mhc", "moe", "block"):
        model = _model(choice, torch.float32)
        by, loss = model_kept(model, lambda m=model: m(ids, packed=packed, labels=labels[0], mtp_labels=labels[1:],
                                                        return_logits=False).loss)
        kept[choice] = by
        loss.backward()
    total = {k: sum(v.values()) for k, v in kept.items()}
    assert total["block"] < total["mhc"] < total["none"] and total["moe"] < total["none"], total
    # mhc recompute: a site keeps only its outputs post [T, n] and comb [T, n, n] (fp32), which the combine uses
    n, rows = 4, packed.num_rows
    sites = {k: v for k, v in kept["mhc"].items() if k.endswith(("attn_hc", "ffn_hc"))}
    assert sites and all(v <= rows * (n + n * n) * 4 for v in sites.values()), sites
    # moe recompute: the MoE keeps (nearly) nothing
    moe = lambda by: sum(v for k, v in by.items() if k.endswith(".mlp"))
    assert moe(kept["moe"]) < moe(kept["none"]) / 4


def test_config_recompute_choices():
    assert tiny_model_config(activation_checkpointing=True).recompute == "block"
    assert tiny_model_config(recompute="block").activation_checkpointing
    with pytest.raises(ValueError, match="recompute must be one of"):
        tiny_model_config(recompute="all")
    d = tiny_model_config(recompute="moe").to_hf_dict()
    assert "recompute" not in d  # a training field: not in config.json
    assert DeepseekV4ModelConfig.from_hf({**d, "recompute": "mhc"}).recompute == "mhc"
