"""PEFT adapters on an HF ``DeepseekV4ForCausalLM`` patched by ``csattn.integrations.transformers.patch``, in
either order: loss and every adapter gradient equal unpatched HF eager + the same PEFT adapters (fp32), every
adapter trains, what csattn cannot honour is refused, and a ``Trainer`` run trains the adapters only."""

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import DataCollatorWithFlattening  # noqa: E402

from csattn.integrations.transformers import is_patched, patch, unpatch  # noqa: E402
from tests.integrations import peft_support as ps  # noqa: E402
from tests.models.model_utils import hf_model, tiny_config_dict  # noqa: E402

TOL = 1e-4  # fp32
SEED = 3
LENGTHS = [13, 29, 7, 21]  # CSA r = 4, HCA r = 8, window 8: documents shorter and longer than each
# every linear of the attention (the indexer's included: q_b_proj, kv_proj, gate_proj, weights_proj match it too),
# the compressors', the shared experts' (gate_proj, up_proj, down_proj); o_a_proj and the routed experts by tensor
MODULES = ["q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", "gate_proj", "weights_proj", "up_proj", "down_proj"]
PARAMETERS = ["o_a_proj.weight", "experts.gate_up_proj", "experts.down_proj"]
ORDERS = ["peft_after_patch", "patch_after_peft"]


def _lora(**kwargs) -> LoraConfig:
    # init_lora_weights=False: lora_B random too, so the adapters change the forward and every factor gets a gradient
    args = dict(r=4, lora_alpha=8, target_modules=MODULES, target_parameters=PARAMETERS, init_lora_weights=False)
    return LoraConfig(**{**args, **kwargs})


def _patched(order: str, cfg: dict, lora: LoraConfig, **patch_kwargs):
    if order == "peft_after_patch":
        return get_peft_model(patch(hf_model(cfg, seed=SEED), **patch_kwargs), lora)
    return patch(get_peft_model(hf_model(cfg, seed=SEED), lora), **patch_kwargs)


def _pair(order: str, pattern: str = "flash", **lora_kwargs):
    """A patched PEFT model and unpatched HF eager + PEFT with the same weights and adapters."""
    cfg = tiny_config_dict(pattern)
    ref = get_peft_model(hf_model(cfg, seed=SEED), _lora(**lora_kwargs))
    ours = _patched(order, cfg, _lora(**lora_kwargs))
    assert is_patched(ours) and not is_patched(ref)
    assert list(ours.state_dict()) == list(ref.state_dict())  # PEFT's names: the adapter files are the same
    ours.load_state_dict(ref.state_dict())
    return ours, ref, cfg


@pytest.mark.parametrize("order", ORDERS)
def test_lora_equals_hf_eager_peft(order, assert_close):
    ours, ref, cfg = _pair(order)
    checked = ps.matches_hf_eager(ours, ref, ps.docs(LENGTHS, cfg["vocab_size"]), assert_close, TOL)
    # 4 layers: q_a, q_b, kv, o_a, o_b, shared gate / up / down, experts' two tensors (10 x 2 factors) each, and the
    # compressors' kv / gate (2 x 2) on the two compressed layers
    assert checked == 4 * 20 + 2 * 4
    trained = ps.adapters(ours)
    for name, p in ours.named_parameters():
        assert p.requires_grad == (name in trained), name  # the base stays frozen


@pytest.mark.parametrize("order", ORDERS)
def test_every_adapter_gets_a_gradient(order):
    """With csattn's indexer loss the indexer's adapters train too: every adapter tensor gets a nonzero gradient."""
    cfg = tiny_config_dict("flash")
    model = _patched(order, cfg, _lora(), indexer_loss_coeff=1.0)
    ps.flattened_loss(model, ps.docs(LENGTHS, cfg["vocab_size"])).backward()
    adapters = ps.adapters(model)
    # + the indexer's q_b_proj, kv_proj, gate_proj, weights_proj (4 x 2 factors) on the CSA layer
    assert len(adapters) == 4 * 20 + 2 * 4 + 8
    missing = [n for n, p in adapters.items() if p.grad is None or torch.count_nonzero(p.grad) == 0]
    assert not missing, missing


def _two_adapters(order: str, first: dict, second: dict):
    """:func:`_pair` with LoRA ``first`` as "default" and ``second`` as "second", both active; and the pair's
    ``logits(model)`` on one document (no grad)."""
    ours, ref, cfg = _pair(order, **first)
    for model in (ours, ref):
        model.add_adapter("second", _lora(**second))
        model.base_model.set_adapter(["default", "second"])
    ours.load_state_dict(ref.state_dict())
    ids = ps.docs([30], cfg["vocab_size"], seed=4)[0][None]

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids).logits

    return ours, ref, logits


@pytest.mark.parametrize("order", ORDERS)
def test_adapter_states_as_in_peft(order, assert_close):
    """Two adapters active at once, adapters disabled, a merged adapter: the patched forward follows PEFT's."""
    first = dict(target_parameters=None, target_modules=["q_b_proj", "o_b_proj", "kv_proj"])
    ours, ref, logits = _two_adapters(order, first, dict(first, target_modules=["q_b_proj", "o_b_proj"]))
    both = logits(ref)
    assert_close(logits(ours), both, TOL, "two active adapters")
    with ours.disable_adapter(), ref.disable_adapter():
        plain = logits(ref)
        assert_close(logits(ours), plain, TOL, "adapters disabled")
    assert (both - plain).abs().max() > 1e-2  # the adapters do change the output
    ours.base_model.merge_adapter()
    assert_close(logits(ours), both, TOL, "merged")
    ours.base_model.unmerge_adapter()
    assert_close(logits(ours), both, TOL, "unmerged again")


def test_expert_adapter_states_as_in_peft(assert_close):
    """LoRA on the routed experts runs as pairs per expert through csattn's grouped GEMMs: two active adapters (other
    scales), adapters disabled, a merged adapter give PEFT's forward."""
    lora = dict(target_modules=["q_a_proj"], target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    ours, ref, logits = _two_adapters("peft_after_patch", lora, dict(lora, lora_alpha=20))
    both = logits(ref)
    assert_close(logits(ours), both, TOL, "two active adapters")
    ours.base_model.set_adapter("second")
    ref.base_model.set_adapter("second")
    assert_close(logits(ours), logits(ref), TOL, "one of them")
    with ours.disable_adapter(), ref.disable_adapter():
        plain = logits(ref)
        assert_close(logits(ours), plain, TOL, "adapters disabled")
    assert (both - plain).abs().max() > 1e-2  # the adapters do change the output
    ours.base_model.set_adapter(["default", "second"])
    ours.base_model.merge_adapter()
    assert_close(logits(ours), both, TOL, "merged")
    ours.base_model.unmerge_adapter()
    assert_close(logits(ours), both, TOL, "unmerged again")


def _refused(order: str, lora, match: str, pattern: str = "flash"):
    cfg = tiny_config_dict(pattern)
    ids = torch.randint(0, cfg["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=match):
        model = _patched(order, cfg, lora)
        model(input_ids=ids)  # adapters added after patch are checked at the forward


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("case", ["dropout", "dora", "lora_bias", "o_a_proj_module", "hc_site", "position_bias",
                                  "loha", "modules_to_save"])
def test_unsupported_adapters_refused(order, case):
    lora = dict(target_parameters=None)
    if case == "dropout":
        _refused(order, _lora(**lora, lora_dropout=0.1), r"self_attn\.q_b_proj.*lora_dropout=0.1")
    elif case == "dora":
        _refused(order, _lora(**lora, use_dora=True), r"q_b_proj.*DoraLinearVariant")
    elif case == "lora_bias":
        _refused(order, _lora(**lora, lora_bias=True), r"q_b_proj.*lora_bias=False")
    elif case == "o_a_proj_module":
        # PEFT itself refuses csattn's grouped linear (no nn.Linear); csattn refuses LoRA on HF's as a module
        _refused(order, _lora(**lora, target_modules=["o_a_proj"]),
                 r"target_parameters=\['self_attn.o_a_proj.weight|GroupedLinear\(\) is not supported")
    elif case == "hc_site":
        _refused(order, _lora(target_modules=None, target_parameters=["attn_hc.fn"]), r"attn_hc.*does not call")
    elif case == "position_bias":
        _refused(order, _lora(target_modules=None, target_parameters=["compressor.position_bias"]),
                 r"layers\.2\.self_attn\.compressor.*does not call")
    elif case == "loha":
        _refused(order, peft.LoHaConfig(r=4, target_modules=["o_b_proj"]), r"o_b_proj.*only plain LoRA.*loha")
    else:
        _refused(order, _lora(target_modules=["q_a_proj"], target_parameters=None, modules_to_save=["q_b_proj"]),
                 r"q_b_proj.*only plain LoRA.*ModulesToSaveWrapper")


def test_other_tuners_on_called_modules_equal_hf(assert_close):
    """A module csattn calls runs PEFT's own forward: other tuner types (LoHa here) work there as in HF."""
    cfg = tiny_config_dict("flash")
    loha = dict(r=4, target_modules=["q_a_proj", "kv_proj"], init_weights=False)
    ref = get_peft_model(hf_model(cfg, seed=SEED), peft.LoHaConfig(**loha))
    ours = patch(get_peft_model(hf_model(cfg, seed=SEED), peft.LoHaConfig(**loha)))
    ours.load_state_dict(ref.state_dict())
    docs = ps.docs([17, 26], cfg["vocab_size"], seed=2)
    loss, expected = ps.flattened_loss(ours, docs), ps.per_document_loss(ref, docs)
    loss.backward()
    expected.backward()
    assert_close(loss, expected, TOL, "loss")
    ref_p = dict(ref.named_parameters())
    trained = [(n, p) for n, p in ours.named_parameters() if p.requires_grad and ".indexer." not in n]
    assert len(trained) == 4 * 2 * 4 + 2 * 4  # hada_w1/w2_a/b per module; kv_proj also on the 2 compressors
    for name, p in trained:
        assert_close(p.grad, ref_p[name].grad, TOL, f"grad {name}")


def test_mixed_adapter_batch_refused():
    cfg = tiny_config_dict("flash")
    model = _patched("peft_after_patch", cfg, _lora(target_parameters=None))
    ids = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    model.eval()  # PEFT takes adapter_names in eval mode only
    with pytest.raises(ValueError, match=r"self_attn\.q_a_proj: mixed adapter batches \(adapter_names=\)"):
        model(input_ids=ids, adapter_names=["default", "__base__"])


@pytest.mark.parametrize("order", ORDERS)
def test_unpatch_keeps_the_adapters(order, assert_close):
    ours, ref, cfg = _pair(order)
    ids = ps.docs([30], cfg["vocab_size"], seed=4)[0][None]
    unpatch(ours)
    assert not is_patched(ours)
    assert list(ours.state_dict()) == list(ref.state_dict())
    with torch.no_grad():
        assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, 0.0, "HF's own forward, the adapters on")
    patch(ours)  # and back: the PEFT model patches again
    with torch.no_grad():
        assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, TOL, "patched again")


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_recomputes_the_adapters(reentrant):
    """HF's gradient checkpointing recomputes the patched layers, the effective weights included: the same adapter
    gradients as without it."""
    cfg = tiny_config_dict("flash")
    plain = _patched("peft_after_patch", cfg, _lora())
    ckpt = _patched("patch_after_peft", cfg, _lora())
    ckpt.load_state_dict(plain.state_dict())
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    docs = ps.docs([25, 15], cfg["vocab_size"], seed=1)
    for model in (plain, ckpt):
        ps.flattened_loss(model, docs).backward()
    expected, got = ps.adapters(plain), ps.adapters(ckpt)
    trained = [n for n, p in expected.items() if p.grad is not None]
    assert len(trained) == 4 * 20 + 2 * 4
    for name in trained:
        torch.testing.assert_close(got[name].grad, expected[name].grad, rtol=0, atol=0, msg=name)


def test_adapter_files_load_into_hf(tmp_path, assert_close):
    """An adapter saved from a patched model is PEFT's format: ``PeftModel.from_pretrained`` on unpatched HF loads it
    to the same outputs, and a patched model loads the saved one back."""
    from peft import PeftModel

    cfg = tiny_config_dict("flash")
    ours = _patched("peft_after_patch", cfg, _lora())
    ours.save_pretrained(tmp_path)
    ids = ps.docs([30], cfg["vocab_size"], seed=4)[0][None]
    with torch.no_grad():
        expected = ours(input_ids=ids).logits
        hf = PeftModel.from_pretrained(hf_model(cfg, seed=SEED), tmp_path)
        assert_close(hf(input_ids=ids).logits, expected, TOL, "HF eager with the saved adapter")
        again = PeftModel.from_pretrained(patch(hf_model(cfg, seed=SEED)), tmp_path)
        assert_close(again(input_ids=ids).logits, expected, 0.0, "a patched model with the saved adapter")


def test_trainer_trains_the_adapters_only(tmp_path):
    from transformers import Trainer, TrainingArguments

    cfg = tiny_config_dict("flash")
    model = _patched("peft_after_patch", cfg, _lora(init_lora_weights=True))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    docs = ps.docs([13, 29, 7, 21], cfg["vocab_size"], seed=9)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2,
                             per_device_train_batch_size=2, learning_rate=1e-2, save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)
    Trainer(model=model, args=args, train_dataset=[{"input_ids": d.tolist()} for d in docs],
            data_collator=DataCollatorWithFlattening()).train()
    adapters = ps.adapters(model)
    assert adapters and all(p.requires_grad for p in adapters.values())
    unchanged = [n for n in adapters if ".indexer." not in n and torch.equal(adapters[n], before[n])]
    assert not unchanged, unchanged
    moved = [n for n, p in model.named_parameters() if n not in adapters and not torch.equal(p, before[n])]
    assert not moved, moved


def test_sft_trainer_with_peft_config(tmp_path):
    """TRL's ``SFTTrainer(peft_config=...)`` on a patched model (it calls ``get_peft_model`` after ``patch``) with its
    defaults: bf16 autocast, gradient checkpointing, padding-free batches. The adapters train, the base does not."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from tests.integrations.test_integration_trl import _tokenizer

    cfg = tiny_config_dict("flash")
    model = patch(hf_model(cfg, seed=SEED))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    docs = ps.docs([13, 29, 7, 21], cfg["vocab_size"], seed=9)
    dataset = Dataset.from_dict({"input_ids": [d.tolist() for d in docs]})
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, per_device_train_batch_size=2,
                     padding_free=True, max_length=None, learning_rate=1e-2, save_strategy="no", logging_steps=1,
                     disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=_tokenizer(64),
                         peft_config=_lora(init_lora_weights=True))
    start = {n: p.detach().clone() for n, p in ps.adapters(trainer.model).items()}  # made by SFTTrainer
    trainer.train()
    peft_model = trainer.model
    assert is_patched(peft_model) and peft_model.is_gradient_checkpointing
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), losses
    adapters = ps.adapters(peft_model)
    unchanged = [n for n, p in adapters.items() if ".indexer." not in n and torch.equal(p, start[n])]
    assert len(adapters) == 4 * 20 + 2 * 4 + 8 and not unchanged, unchanged
    base = {n.replace("base_model.model.", "", 1).replace(".base_layer", ""): p
            for n, p in peft_model.named_parameters() if n not in adapters}
    assert set(base) == set(before)
    moved = [n for n, p in base.items() if not torch.equal(p, before[n])]
    assert not moved, moved

