"""HF + PEFT on csattn's kernels (``patch``) trains as csattn's own LoRA: the same base weights, the same adapter
(csattn's, saved in PEFT's format and loaded with ``PeftModel.from_pretrained``), the same packed documents give the
same loss, every adapter gradient equal, and each optimizer step on the adapters alone the same update (fp32, 1e-4
relative). Each step starts both from the same adapter (csattn's copied into PEFT's after the comparison): the two
sum the same products in other orders (1e-5 apart at a step), and left to run apart their adapters' differences
grow through the steps by what the CPU's fp32 kernels round (1.03e-4 by step 2 on one machine, less on another)."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from transformers import DataCollatorWithFlattening  # noqa: E402

from csattn.finetune import LoraSpec, add_lora, apply_freezing, init_lora, resolve_choice  # noqa: E402
from csattn.finetune.lora import LoraExperts, lora_modules  # noqa: E402
from csattn.finetune.peft_format import adapter_tensors, save_adapter  # noqa: E402
from csattn.integrations.transformers import is_patched, patch  # noqa: E402
from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig, future_tokens  # noqa: E402
from csattn.packing import PackedSeqs  # noqa: E402
from tests.models.model_utils import hf_model, tiny_config_dict  # noqa: E402

TOL = 1e-4  # fp32
TARGETS = ("attention", "indexer", "compressor", "shared_experts", "experts")
BATCHES = ([13, 29, 7, 21], [30, 11, 19], [8, 25, 17])  # CSA r = 4, HCA r = 8, window 8: shorter and longer docs
STEPS = 3


def _csattn_lora(hf, cfg: dict) -> tuple[DeepseekV4ForCausalLM, LoraSpec]:
    """csattn's model on HF's weights, LoRA on every group it adapts; ``B`` random (a trained adapter) so every
    factor gets a gradient."""
    model = DeepseekV4ForCausalLM(DeepseekV4ModelConfig.from_hf(cfg, backend="reference"))
    model.load_state_dict(hf.state_dict(), strict=True)
    spec = LoraSpec(4, 8.0, 0.0, TARGETS)
    apply_freezing(model, resolve_choice(None, None, ",".join(TARGETS), spec.rank))
    add_lora(model, spec)
    init_lora(model, seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, m in lora_modules(model):
            for p in (m.factors() if isinstance(m, LoraExperts) else [m.lora_A, m.lora_B]):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model, spec


def _docs(lengths, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def _csattn_loss(model, docs):
    ids = torch.cat(docs)
    packed = PackedSeqs.from_lengths([len(d) for d in docs])
    return model(ids, packed=packed, labels=future_tokens(ids, packed, 1)[0]).loss


def _hf_loss(model, docs):
    return model(**DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs])).loss


def _peft_adapters(model) -> dict[str, torch.nn.Parameter]:
    """The PEFT model's adapter tensors under the adapter file's keys (``.default`` dropped)."""
    return {n.replace(".default", ""): p for n, p in model.named_parameters() if ".lora_" in n}


def _csattn_grads(model) -> dict[str, torch.Tensor]:
    """csattn's adapter gradients under the adapter file's keys (zeros where none reached a factor)."""
    params = dict(model.named_parameters())
    return adapter_tensors(model, lambda name, t: torch.zeros_like(t) if params[name].grad is None
                           else params[name].grad)


def test_hf_peft_patched_trains_as_csattn_lora(tmp_path, assert_close):
    cfg = tiny_config_dict("flash")  # 8 indexer heads: no exact ties in the indexer's top-k
    hf = hf_model(cfg, seed=3)
    ours, spec = _csattn_lora(hf, cfg)
    save_adapter(ours, str(tmp_path), spec)
    from peft import PeftModel

    theirs = patch(PeftModel.from_pretrained(hf, str(tmp_path), is_trainable=True))
    assert is_patched(theirs)
    peft_p = _peft_adapters(theirs)
    assert set(peft_p) == set(adapter_tensors(ours))
    trainable = {n for n, p in theirs.named_parameters() if p.requires_grad}
    assert len(trainable) == len(peft_p)  # the adapters, nothing else

    lr = 0.05
    opt_ours = torch.optim.SGD([p for p in ours.parameters() if p.requires_grad], lr=lr, momentum=0.9)
    opt_theirs = torch.optim.SGD(list(peft_p.values()), lr=lr, momentum=0.9)
    start = {k: v.detach().clone() for k, v in peft_p.items()}
    for step in range(STEPS):
        docs = _docs(BATCHES[step], cfg["vocab_size"], seed=step)
        loss, expected = _hf_loss(theirs, docs), _csattn_loss(ours, docs)
        loss.backward()
        expected.backward()
        assert_close(loss, expected, TOL, f"step {step}: loss")
        want = _csattn_grads(ours)
        reached = 0
        for key, p in peft_p.items():
            if ".indexer." in key:  # no LM gradient reaches the indexer, on either side (as in HF)
                assert p.grad is None or torch.count_nonzero(p.grad) == 0, key
                assert torch.count_nonzero(want[key]) == 0, key
                continue
            assert p.grad is not None and torch.count_nonzero(p.grad) > 0, key
            assert_close(p.grad, want[key], TOL, f"step {step}: grad {key}")
            reached += 1
        # 4 layers x (q_a, q_b, kv, o_a, o_b, shared gate / up / down, experts' two tensors) x 2 factors, and the
        # compressors' kv / gate (2 x 2) on the two compressed layers
        assert reached == 4 * 20 + 2 * 4
        opt_ours.step()
        opt_theirs.step()
        opt_ours.zero_grad(set_to_none=True)
        opt_theirs.zero_grad(set_to_none=True)
        now = adapter_tensors(ours)
        with torch.no_grad():
            for key, p in peft_p.items():
                assert_close(p, now[key], TOL, f"after step {step}: {key}")
                p.copy_(now[key])  # the next step from the same adapter
    for key, p in peft_p.items():
        if ".indexer." not in key:
            assert (p - start[key]).abs().max() > 1e-4, key  # the steps moved it
