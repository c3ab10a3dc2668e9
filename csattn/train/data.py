"""Token corpora addressed by document index, so a packer position (document, offset) is the whole data
state and resuming is exact.

* ``SyntheticCorpus`` (the default): documents drawn from a fixed sparse Markov chain (each token has three
  likely successors), and every other document repeats its first half, so there is structure for the
  MLP (bigrams) and for attention (copying) to learn. Deterministic in ``(seed, index)``; endless.
* ``TextCorpus``: byte-level tokens (vocabulary 256) of text files, one document per file or per paragraph.
  ``python_source_corpus()`` uses the Python standard library's own ``.py`` files, a text dataset that ships
  with every Python installation (no download).
"""

from __future__ import annotations

import os
import sysconfig
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["Corpus", "SyntheticCorpus", "TextCorpus", "python_source_corpus", "build_corpus"]


class Corpus(Protocol):
    vocab_size: int

    def document(self, index: int) -> Tensor:
        """Token ids ``[L]`` int64 (L >= 1) of document ``index`` (any index >= 0)."""
        ...


class SyntheticCorpus:
    """Markov-chain documents with copy structure.

    Args:
        vocab_size: token ids ``0..vocab_size-1``; id 0 is the document start token.
        seed: fixes the chain and every document.
        min_len, max_len: document lengths are uniform in ``[min_len, max_len]``.
    """

    def __init__(self, vocab_size: int = 256, seed: int = 0, min_len: int = 8, max_len: int = 96) -> None:
        if vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4, got {vocab_size}")
        if not 2 <= min_len <= max_len:
            raise ValueError(f"need 2 <= min_len <= max_len, got {min_len}, {max_len}")
        self.vocab_size, self.seed, self.min_len, self.max_len = vocab_size, seed, min_len, max_len
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(1, vocab_size, (vocab_size, 3), generator=g)
        self.probs = torch.tensor([0.7, 0.2, 0.1])

    def document(self, index: int) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 1)
        length = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=g))
        choice = torch.multinomial(self.probs, length, replacement=True, generator=g)
        tokens = torch.empty(length, dtype=torch.long)
        tokens[0] = 0
        tokens[1] = int(torch.randint(1, self.vocab_size, (1,), generator=g))
        for i in range(2, length):
            tokens[i] = self.successors[tokens[i - 1], choice[i]]
        if index % 2 and length >= 4:  # copy task: second half repeats the first
            half = length // 2
            tokens[half:2 * half] = tokens[:half]
        return tokens


class TextCorpus:
    """Byte-level documents from text files (vocabulary 256), visited in a seeded order per epoch."""

    vocab_size = 256

    def __init__(self, paths: list[str], seed: int = 0, split_paragraphs: bool = False,
                 max_doc_bytes: int = 1 << 16) -> None:
        docs: list[bytes] = []
        for path in sorted(paths):
            with open(path, "rb") as f:
                data = f.read(max_doc_bytes if not split_paragraphs else -1)
            parts = data.split(b"\n\n") if split_paragraphs else [data]
            docs += [p[:max_doc_bytes] for p in parts if len(p) >= 2]
        if not docs:
            raise ValueError(f"no documents of >= 2 bytes in {len(paths)} file(s)")
        self.docs, self.seed = docs, seed
        self._orders: dict[int, Tensor] = {}

    def __len__(self) -> int:
        return len(self.docs)

    def document(self, index: int) -> Tensor:
        epoch, i = divmod(index, len(self.docs))
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._orders = {epoch: torch.randperm(len(self.docs), generator=g)}
        data = self.docs[int(self._orders[epoch][i])]
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def python_source_corpus(seed: int = 0, max_files: int = 400) -> TextCorpus:
    """The ``.py`` files at the top of the standard library directory, as bytes."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".py"))[:max_files]
    return TextCorpus(files, seed=seed)


def build_corpus(name: str, vocab_size: int, seed: int, text_paths: list[str] | None = None,
                 min_len: int = 8, max_len: int = 96) -> Corpus:
    """``"synthetic"``, ``"pysrc"`` (standard-library sources) or ``"text"`` (``text_paths``)."""
    if name == "synthetic":
        return SyntheticCorpus(vocab_size, seed, min_len, max_len)
    if name in ("pysrc", "text"):
        if vocab_size < 256:
            raise ValueError(f"byte-level data needs vocab_size >= 256, got {vocab_size}")
        if name == "pysrc":
            return python_source_corpus(seed)
        if not text_paths:
            raise ValueError("data 'text' needs --text-path FILE [FILE ...]")
        return TextCorpus(list(text_paths), seed=seed, split_paragraphs=True)
    raise ValueError(f"data must be synthetic, pysrc or text, got {name!r}")
