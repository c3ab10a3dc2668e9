"""Adapters in PEFT's format: csattn's saved adapter loads into ``transformers.DeepseekV4ForCausalLM`` with
``peft.PeftModel.from_pretrained`` and gives csattn's LoRA logits (fp32, 1e-5 relative), and so does the merged
export; the adapter loads back into csattn bit for bit; what does not fit is refused."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from csattn.finetune import LoraSpec, add_lora, apply_freezing, init_lora, resolve_choice  # noqa: E402
from csattn.finetune.lora import LoraExperts, lora_modules  # noqa: E402
from csattn.finetune.peft_format import load_adapter, merged_state_dict, save_adapter  # noqa: E402
from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig  # noqa: E402
from csattn.packing import PackedSeqs  # noqa: E402
from tests.models.model_utils import hf_model, tiny_config_dict  # noqa: E402

ALL = ("attention", "indexer", "compressor", "shared_experts", "experts")
TOL = 1e-5


def _ours(hf, cfg, targets=ALL, rank=4, alpha=8.0, seed=0, train=None):
    model = DeepseekV4ForCausalLM(DeepseekV4ModelConfig.from_hf(cfg, backend="reference"))
    model.load_state_dict(hf.state_dict(), strict=True)
    if targets:
        spec = LoraSpec(rank, alpha, 0.0, targets)
        apply_freezing(model, resolve_choice(train, None, ",".join(targets), rank))
        add_lora(model, spec)
        init_lora(model, seed)
        return model, spec
    return model, None


def _random_b(model, seed=5):
    """Nonzero B everywhere (a trained adapter), so every factor shows in the logits; the parameters trained in
    full (and the routers' balance biases) moved too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora_modules(model):
            for p in (m.factors() if isinstance(m, LoraExperts) else [m.lora_A, m.lora_B]):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        trained = {n.rpartition(".")[0] for n, q in model.named_parameters() if q.requires_grad and ".lora_" not in n}
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.rpartition(".")[0] in trained and (t.requires_grad or name.endswith("e_score_correction_bias")):
                t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.05)


def _logits(model, ids):
    return model(ids.reshape(-1), packed=PackedSeqs.uniform(*ids.shape)).logits.detach()


@pytest.mark.parametrize("pattern,targets,train", [("flash", ALL, None), ("mixed", ("attention", "experts"), None),
                                                   ("flash", ("attention",), "router,mhc,head,embed,shared_experts")])
def test_peft_loads_csattn_adapter_into_hf(pattern, targets, train, tmp_path, assert_close):
    from peft import PeftModel

    cfg = tiny_config_dict(pattern)
    hf = hf_model(cfg, seed=3)
    ours, spec = _ours(hf, cfg, targets, train=train)
    _random_b(ours)
    ids = torch.randint(0, cfg["vocab_size"], (1, 33), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        base_hf = hf(input_ids=ids).logits[0]
        want = _logits(ours, ids)
    save_adapter(ours, str(tmp_path), spec)
    conf = json.load(open(tmp_path / "adapter_config.json"))
    assert any(t.endswith("experts.gate_up_proj") for t in conf["target_parameters"]) == ("experts" in targets)
    assert bool(conf["modules_to_save"]) == bool(train)
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path))
    with torch.no_grad():
        got = peft_model(input_ids=ids).logits[0]
    assert (got - base_hf).abs().max() > 1e-2  # the adapter changes the logits: every key loaded, or this fails
    assert_close(got, want, TOL, "HF + PEFT adapter vs csattn LoRA")
    # the merged export: csattn's and HF's model built from it give the same logits
    merged = merged_state_dict(ours)
    hf2 = hf_model(cfg, seed=3)  # PEFT wrapped hf's modules in place
    plain, _ = _ours(hf2, cfg, targets=())
    plain.load_state_dict(merged, strict=True)
    assert_close(_logits(plain, ids), want, TOL, "merged export (csattn)")
    hf2.load_state_dict(merged, strict=True)
    with torch.no_grad():
        assert_close(hf2(input_ids=ids).logits[0], want, TOL, "merged export (HF)")
    # PEFT's own merge of the adapter equals ours
    merged_peft = peft_model.merge_and_unload().state_dict()
    for name, t in merged.items():
        if name in merged_peft:
            assert_close(merged_peft[name], t, 1e-6, name)


def test_adapter_loads_back_into_csattn(tmp_path):
    cfg = tiny_config_dict("flash")
    hf = hf_model(cfg, seed=3)
    ours, spec = _ours(hf, cfg)
    _random_b(ours)
    save_adapter(ours, str(tmp_path), spec)
    fresh, _ = _ours(hf, cfg, seed=9)
    load_adapter(fresh, str(tmp_path))
    for (n, p), (_, q) in zip(ours.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), n
    ids = torch.randint(0, cfg["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(fresh, ids), _logits(ours, ids))


def test_load_refuses_what_does_not_fit(tmp_path):
    cfg = tiny_config_dict("flash")
    hf = hf_model(cfg, seed=3)
    ours, spec = _ours(hf, cfg, targets=("attention",))
    save_adapter(ours, str(tmp_path), spec)
    other, _ = _ours(hf, cfg, targets=("attention", "experts"))
    with pytest.raises(ValueError, match="do not fit the model's LoRA"):
        load_adapter(other, str(tmp_path))
    wider, _ = _ours(hf, cfg, targets=("attention",), rank=8, alpha=16.0)
    with pytest.raises(ValueError, match="shape"):
        load_adapter(wider, str(tmp_path))
    scaled, _ = _ours(hf, cfg, targets=("attention",), alpha=2.0)
    with pytest.raises(ValueError, match="scale"):
        load_adapter(scaled, str(tmp_path))
    os.remove(tmp_path / "adapter_config.json")
    with pytest.raises(ValueError, match="not a readable PEFT adapter config"):
        load_adapter(ours, str(tmp_path))
