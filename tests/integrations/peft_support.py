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
