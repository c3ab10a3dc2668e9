"""Parameter groups (every parameter of the model, MTP included, in exactly one) and LoRA on the tiny model: step 0
equals the base bit for bit, gradients reach the factors and only them, each kind of adapted module computes
``W + scale * B @ A`` and its factors get the gradients the merged weight's gradient gives, the flags' conflicts are
refused."""

from __future__ import annotations

import math

import pytest
import torch

from csattn.finetune import GROUPS, Choice, LoraSpec, add_lora, apply_freezing, group_of, init_lora, resolve_choice
from csattn.finetune.lora import LoraExperts, LoraLinear, LoraWeight, lora_delta, lora_modules
from csattn.finetune.peft_format import saved_modules
from csattn.packing import PackedSeqs
from tests.models.model_utils import tiny_model


def _loss(model, ids, lengths):
    out = model(ids, packed=PackedSeqs.from_lengths(lengths), labels=torch.roll(ids, -1))
    return out.loss, out.logits


def _lora_model(targets=("attention", "indexer", "compressor", "shared_experts", "experts"), rank=4, alpha=8.0,
                seed=0, **model_kw):
    model = tiny_model("mixed", mtp=1, **model_kw).double()
    choice = resolve_choice(None, None, ",".join(targets), rank)
    apply_freezing(model, choice)
    add_lora(model, LoraSpec(rank, alpha, 0.0, choice.lora))
    init_lora(model, seed)
    return model


def test_every_parameter_in_one_group():
    model = tiny_model("mixed", mtp=1)
    seen = {g: 0 for g in GROUPS}
    for name, _ in model.named_parameters():
        seen[group_of(name)] += 1  # raises for a parameter of no group
    assert all(seen.values()), seen
    assert group_of("mtp.0.e_proj.weight") == "head" and group_of("model.layers.1.attn_hc.fn") == "mhc"
    assert group_of("model.layers.0.self_attn.compressor.indexer.q_b_proj.weight") == "indexer"
    assert group_of("model.layers.0.self_attn.compressor.kv_proj.weight") == "compressor"


def test_step0_bitwise_equal_and_grads_only_on_factors():
    base = tiny_model("mixed", mtp=1).double()
    model = _lora_model()
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(1))
    want_loss, want_logits = _loss(base, ids, [17, 23])
    loss, logits = _loss(model, ids, [17, 23])
    assert torch.equal(logits, want_logits) and torch.equal(loss, want_loss)
    loss.backward()
    kinds = {type(m).__mro__[0] for _, m in lora_modules(model)}
    assert LoraExperts in kinds and LoraLinear in kinds and any(issubclass(k, LoraWeight) for k in kinds)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            assert p.requires_grad and p.grad is not None, name
            # B = 0: only B's gradient is nonzero at step 0 (A's is scale * B^T ...); the indexer's keys learn only
            # through the indexer loss, none here
            if "lora_B" in name and ".indexer." not in name:
                assert p.grad.abs().sum() > 0, name
        else:
            assert not p.requires_grad and p.grad is None, name
    assert not any(name.startswith("mtp.") and ".lora_" in name for name, _ in model.named_parameters())


def _with_merged(g: torch.Generator, **model_kw):
    """A LoRA model with nonzero ``B`` everywhere, the base model with every delta merged into its weights, and the
    latter's parameters by name (fp64)."""
    model = _lora_model(**model_kw)
    merged = tiny_model("mixed", mtp=1, **model_kw).double()
    with torch.no_grad():
        for _, m in lora_modules(model):
            for p in (m.factors()[1::2] if isinstance(m, LoraExperts) else [m.lora_B]):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
        own = dict(merged.named_parameters())
        for name, m in lora_modules(model):
            for pname, d in lora_delta(m).items():
                own[f"{name}.{pname}"].add_(d)
    return model, merged, own


def test_lora_equals_merged_weights(assert_close):
    """With nonzero B, each adapted module computes its base on ``W + scale * B @ A`` (fp64)."""
    g = torch.Generator().manual_seed(3)
    model, merged, _ = _with_merged(g)
    ids = torch.randint(0, 64, (40,), generator=g)
    loss, logits = _loss(model, ids, [40])
    want_loss, want_logits = _loss(merged, ids, [40])
    assert_close(logits, want_logits, 1e-12, "logits")


def test_factor_gradients_equal_the_merged_weights_gradients(assert_close):
    """Every adapted module runs its term factored (the attention core by hand, the shared expert through the
    grouped GEMMs, the indexer's queries through autograd on the factors): the loss and each factor's gradient
    equal those that the merged model's weight gradient ``dW`` gives, ``dA = scale B^T dW``, ``dB = scale dW A^T``
    (fp64, per expert for the experts), and no frozen base weight gets a gradient. With the indexer loss on, so
    that the indexer's pair learns."""
    g = torch.Generator().manual_seed(5)
    model, merged, own = _with_merged(g, indexer_loss_coeff=0.5)
    for p in merged.parameters():
        p.requires_grad_(p.is_floating_point())
    ids = torch.randint(0, 64, (48,), generator=g)
    loss, _ = _loss(model, ids, [30, 18])
    want, _ = _loss(merged, ids, [30, 18])
    assert_close(loss, want, 1e-12, "loss")
    loss.backward()
    want.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n and not p.requires_grad)
    for name, m in lora_modules(model):
        if isinstance(m, LoraExperts):
            pairs = [("gate_up_proj", m.lora_A_gate_up, m.lora_B_gate_up), ("down_proj", m.lora_A_down, m.lora_B_down)]
        else:
            pairs = [("weight", m.lora_A, m.lora_B)]
        for pname, a, b in pairs:
            dw = own[f"{name}.{pname}"].grad
            assert dw is not None and dw.abs().sum() > 0, name  # every pair learns (the indexer's by its loss)
            s = m.lora_scale
            assert_close(a.grad, s * b.detach().transpose(-2, -1) @ dw, 1e-10, f"{name} A")
            assert_close(b.grad, s * dw @ a.detach().transpose(-2, -1), 1e-10, f"{name} B")


def test_lora_a_init_is_peft_kaiming():
    model = _lora_model(rank=8)
    for _, m in lora_modules(model):
        a = m.lora_A_gate_up if isinstance(m, LoraExperts) else m.lora_A
        bound = 1 / math.sqrt(a.shape[-1])
        assert a.abs().max() <= bound and a.abs().max() > 0.5 * bound
        b = m.lora_B_down if isinstance(m, LoraExperts) else m.lora_B
        assert torch.count_nonzero(b) == 0


def test_choices_and_conflicts():
    c = resolve_choice(None, "experts,embed", None, 0)
    assert "experts" not in c.train and "attention" in c.train and not c.lora
    assert resolve_choice("attention,head", None, None, 0).train == ("attention", "head")
    assert resolve_choice(None, None, None, 8).lora == ("attention", "indexer", "shared_experts", "experts")
    assert resolve_choice(None, None, None, 8).train == ()
    with pytest.raises(ValueError, match="--train and --freeze"):
        resolve_choice("attention", "experts", None, 0)
    with pytest.raises(ValueError, match="--lora-targets needs --lora-rank"):
        resolve_choice(None, None, "attention", 0)
    with pytest.raises(ValueError, match="--freeze experts and --lora-targets experts"):
        resolve_choice(None, "experts", "experts,attention", 4)
    with pytest.raises(ValueError, match="--lora-targets: unknown group.*'router'"):
        resolve_choice(None, None, "router", 4)
    assert resolve_choice("router,mhc", None, None, 4) == Choice(
        train=("mhc", "router"), lora=("attention", "indexer", "shared_experts", "experts"))
    with pytest.raises(ValueError, match="--train attention and --lora-targets attention"):
        resolve_choice("attention", None, "attention", 4)
    with pytest.raises(ValueError, match="--train attention with --lora-targets indexer: the attention module"):
        resolve_choice("attention", None, "indexer,experts", 4)
    with pytest.raises(ValueError, match="--train compressor with --lora-targets indexer"):
        resolve_choice("compressor", None, "indexer", 4)
    model = tiny_model("mixed")  # the modules PEFT saves whole hold no LoRA module
    choice = resolve_choice("compressor,mhc,router", None, "attention,experts", 4)
    apply_freezing(model, choice)
    add_lora(model, LoraSpec(4, 8.0, 0.0, choice.lora))
    saved = saved_modules(model)
    assert "model.layers.0.mlp.gate" in saved and "model.layers.0.attn_hc" in saved
    assert "model.layers.0.self_attn.compressor" in saved and not any(".compressor." in s for s in saved)


def test_dropout_refused_where_the_weight_is_read():
    model = tiny_model("mixed")
    with pytest.raises(ValueError, match="--lora-dropout 0.1: the groups attention"):
        add_lora(model, LoraSpec(4, 8.0, 0.1, ("attention", "compressor")))
    with pytest.raises(ValueError, match="--lora-dropout 0.1: the groups experts"):  # as the trainer's options
        add_lora(tiny_model("mixed"), LoraSpec(4, 8.0, 0.1, ("experts",)))
    model = tiny_model("mixed")
    names = add_lora(model, LoraSpec(4, 8.0, 0.1, ("compressor",)))
    assert names and all(isinstance(dict(model.named_modules())[n], LoraLinear) for n in names)
    with pytest.raises(ValueError, match="already has LoRA"):
        add_lora(model, LoraSpec(4, 8.0, 0.0, ("attention",)))


@pytest.mark.parametrize("recompute", ["moe", "block", "full"])
def test_recompute_gives_the_same_factor_gradients(recompute, assert_close):
    """The readers' projections (weight and LoRA term, the indexer's merged) are taken again when a checkpoint
    recomputes a block (the reader's forward runs again): the factors' gradients equal those without recompute
    (fp64)."""
    from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig
    from tests.models.model_utils import randomize_model_, tiny_config_dict

    def run(mode):
        torch.manual_seed(0)
        model = DeepseekV4ForCausalLM(DeepseekV4ModelConfig.from_hf(tiny_config_dict("mixed"), recompute=mode))
        randomize_model_(model, 1)
        model = model.double()
        choice = resolve_choice(None, None, "attention,indexer,shared_experts,experts", 4)
        apply_freezing(model, choice)
        add_lora(model, LoraSpec(4, 8.0, 0.0, choice.lora))
        init_lora(model, 0)
        with torch.no_grad():  # nonzero B: A's gradients are nonzero too
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)),
                                        dtype=p.dtype) * 0.1)
        ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(2))
        _loss(model, ids, [40])[0].backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want, got = run("none"), run(recompute)
    assert want.keys() == got.keys() and want
    for name in want:
        assert_close(got[name], want[name], 1e-10, name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_experts_without_rows_give_zero_factor_gradients(dtype):
    """An expert-parallel rank that receives no rows still reduces every factor's gradient: zeros, not None
    (fp64 takes the reference loop, fp32 the grouped path)."""
    model = _lora_model(targets=("experts",))
    experts = next(m for _, m in lora_modules(model) if isinstance(m, LoraExperts)).to(dtype)
    x = torch.zeros(0, experts.gate_up_proj.shape[-1], dtype=dtype, requires_grad=True)
    y = experts(x, torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1, dtype=dtype))
    grads = torch.autograd.grad(y.sum(), experts.factors(), allow_unused=True)
    assert all(g is not None and torch.count_nonzero(g) == 0 for g in grads)
