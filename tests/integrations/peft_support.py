"""Helpers shared by the PEFT integration tests: documents, the flattened (patched) loss, HF eager's per-document
reference, the adapter tensors."""

import torch
from transformers import DataCollatorWithFlattening


def docs(lengths, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def flattened_loss(model, documents, device: str = "cpu") -> torch.Tensor:
    """The model's loss on ``documents`` flattened into one row by ``DataCollatorWithFlattening``."""
    batch = DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in documents])
    return model(**{k: v.to(device) for k, v in batch.items()}).loss


def per_document_loss(ref, documents) -> torch.Tensor:
    """HF eager on each document alone, weighted as the flattened batch's mean over its L - 1 targets per document."""
    total = sum(len(d) - 1 for d in documents)
    return sum(ref(input_ids=d[None], labels=d[None]).loss * (len(d) - 1) for d in documents) / total


def adapters(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


def matches_hf_eager(ours, ref, documents, assert_close, tol: float) -> int:
    """``ours`` (a patched model with PEFT adapters) on the flattened ``documents`` against HF eager with the same
    adapters one document at a time (``ref``): the loss and every adapter gradient within ``tol``; the adapters HF's LM
    loss gives no gradient (the indexer's) get none, or zeros, in ``ours`` too. Returns how many gradients were
    compared (each nonzero: its reference is, and the error is relative)."""
    loss = flattened_loss(ours, documents)
    loss.backward()
    expected = per_document_loss(ref, documents)
    expected.backward()
    assert_close(loss, expected, tol, "loss")
    ours_p, ref_p = adapters(ours), adapters(ref)
    assert set(ours_p) == set(ref_p)
    checked = 0
    for name, p in ref_p.items():
        got = ours_p[name].grad
        if p.grad is None:
            assert ".indexer." in name, name
            assert got is None or torch.count_nonzero(got) == 0, name
            continue
        assert got is not None and torch.count_nonzero(p.grad) > 0, name
        assert_close(got, p.grad, tol, f"grad {name}")
        checked += 1
    return checked
