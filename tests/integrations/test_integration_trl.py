"""A patched HF ``DeepseekV4ForCausalLM`` trained by ``transformers.Trainer(bf16=True)`` and by TRL's
``SFTTrainer`` with its defaults (bf16 autocast, gradient checkpointing, the load-balancing loss at
``router_aux_loss_coef = 0.001``, the fused LM head) on padding-free batches, with packing and without
checkpointing: each run's logged losses
equal the same run in fp32 within bf16 rounding, and the weights stay fp32 and finite. Before, autocast failed in
the attention's output projection and ``output_router_logits=True`` was refused. Tiny model, two or three
steps."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from csattn.integrations.transformers import patch, unpatch  # noqa: E402
from tests.models.model_utils import hf_model, tiny_config_dict  # noqa: E402

LENGTHS = [13, 29, 7, 21, 16, 34, 11, 25]


def _docs(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(9)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _tokenizer(vocab: int):
    """A word-level tokenizer over ``t0 .. t{vocab-1}`` (pad t0, unk t1, eos t2), built in memory."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", unk_token="t1", eos_token="t2")


def _losses(trainer) -> list[float]:
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(torch.isfinite(torch.tensor(losses))), losses
    for name, p in trainer.model.named_parameters():
        assert p.dtype == torch.float32 and torch.isfinite(p).all(), name
    return losses


def _check_close(bf16: list[float], fp32: list[float]) -> None:
    assert len(bf16) == len(fp32)
    for step, (a, b) in enumerate(zip(bf16, fp32)):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {step}: bf16 loss {a} vs fp32 {b}"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_trainer_bf16_equals_fp32_within_rounding(tmp_path, device):
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    cfg = tiny_config_dict("flash")
    runs = {}
    for bf16 in (True, False):
        args = TrainingArguments(output_dir=str(tmp_path / str(bf16)), use_cpu=device == "cpu", report_to=[],
                                 max_steps=3,
                                 per_device_train_batch_size=2, learning_rate=1e-3, bf16=bf16, save_strategy="no",
                                 logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, seed=0)
        trainer = Trainer(model=patch(hf_model(cfg, seed=3)), args=args, data_collator=DataCollatorWithFlattening(),
                          train_dataset=[{"input_ids": d} for d in _docs(cfg["vocab_size"])])
        runs[bf16] = _losses(trainer)
    _check_close(runs[True], runs[False])


@pytest.mark.parametrize("options", [
    dict(),
    dict(activation_checkpointing=False),
    dict(packing=True, max_length=48),
], ids=["padding_free", "no_checkpointing", "packing"])
@pytest.mark.parametrize("device", DEVICES)
def test_sft_trainer_defaults_padding_free(options, tmp_path, device):
    """SFTTrainer's defaults: bf16 autocast, gradient checkpointing, the MoE auxiliary loss
    (``output_router_logits=True``), its fused LM head; padding-free batches (``position_ids`` and
    ``cu_seq_lens_*``), or packed ones (BFD packing); and without gradient checkpointing."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    cfg = tiny_config_dict("flash")
    dataset = Dataset.from_dict({"input_ids": _docs(cfg["vocab_size"])})
    extra = dict(options)
    max_length = extra.pop("max_length", None)  # padding-free without packing wants none
    runs, aux = {}, {}
    for bf16 in (True, False):
        model = patch(hf_model(cfg, seed=3))
        assert model.config.router_aux_loss_coef > 0  # HF's default: TRL asks for the router logits
        args = SFTConfig(output_dir=str(tmp_path / str(bf16)), use_cpu=device == "cpu", report_to=[], max_steps=2,
                         per_device_train_batch_size=2, padding_free=True, max_length=max_length, save_strategy="no",
                         logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, seed=0, **extra,
                         **({} if bf16 else {"bf16": False}))
        assert args.bf16 == bf16  # SFTConfig's default
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=_tokenizer(64))
        runs[bf16] = _losses(trainer)
        assert model.is_gradient_checkpointing == extra.get("activation_checkpointing", True)  # TRL's default
        aux[bf16] = [log["aux_loss"] for log in trainer.state.log_history if "aux_loss" in log]
        unpatch(model)
        assert not hasattr(model.config, "num_experts")  # the alias patch gave TRL is gone with it
    assert aux[True] and all(a > 0 for a in aux[True])
    _check_close(runs[True], runs[False])
    _check_close(aux[True], aux[False])
