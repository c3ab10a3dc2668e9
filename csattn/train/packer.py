"""Packs documents into fixed-size batches of ``seq_len`` rows with ``cu_seqlens``.

Each batch is one packed stream: documents laid end to end, each physically padded up to a multiple of
``pad_multiple`` rows (the padded prefix sum is ``cu_seqlens_padded``; ``cu_seqlens`` counts real tokens).
``seq_len`` is fixed so it can be made divisible by the context-parallel size. A document that does not fit
in what is left of a batch is cut: the rest starts the next batch as a new document (``split=True``), or
the batch is closed with padding and the document starts the next one (``split=False``; documents longer
than ``seq_len`` are still cut). The packer's whole state is ``(next document, offset)``, plus the corpus's
read position when the corpus is a stream (it has ``state_dict``: :class:`~.data.JsonlCorpus`,
:class:`~.data.ParquetCorpus`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..models.deepseek_v4.model import future_tokens
from ..packing import PackedSeqs
from .data import Corpus

__all__ = ["concat_batches", "PackedBatch", "DocumentPacker"]


@dataclass
class PackedBatch:
    """One packed stream: ``input_ids [T]``, ``labels [1 + mtp, T]`` (next token, then MTP targets)."""

    input_ids: Tensor
    labels: Tensor
    packed: PackedSeqs
    lengths: list[int]
    padded_lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def concat_batches(batches: list[PackedBatch]) -> PackedBatch:
    """The packed streams of ``batches`` back to back (their documents side by side in one stream)."""
    if len(batches) == 1:
        return batches[0]
    lengths = [n for b in batches for n in b.lengths]
    padded = [n for b in batches for n in b.padded_lengths]
    return PackedBatch(torch.cat([b.input_ids for b in batches]), torch.cat([b.labels for b in batches], dim=1),
                       PackedSeqs.from_lengths(lengths, padded), lengths, padded)


class DocumentPacker:
    """Iterator of :class:`PackedBatch`.

    Args:
        corpus: documents by index. seq_len: rows per batch (multiple of ``pad_multiple``).
        pad_multiple: physical length multiple of every document piece.
        label_depth: label rows per batch (1 + number of MTP blocks).
        shard, num_shards: data-parallel replica ``shard`` reads documents ``shard, shard + num_shards, ...``.
        split: cut documents at batch ends (no padding) or close the batch with padding.
    """

    def __init__(self, corpus: Corpus, seq_len: int, pad_multiple: int = 1, label_depth: int = 1, shard: int = 0,
                 num_shards: int = 1, split: bool = True, pad_id: int = 0) -> None:
        if seq_len < 1 or pad_multiple < 1 or seq_len % pad_multiple:
            raise ValueError(f"seq_len ({seq_len}) must be a positive multiple of pad_multiple ({pad_multiple})")
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in [0, {num_shards}), got {shard}")
        self.corpus, self.seq_len, self.pad_multiple = corpus, seq_len, pad_multiple
        self.label_depth, self.shard, self.num_shards = label_depth, shard, num_shards
        self.split, self.pad_id = split, pad_id
        self.doc, self.offset = 0, 0  # the doc-th document of this shard, tokens already consumed

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"doc": self.doc, "offset": self.offset}
        if hasattr(self.corpus, "state_dict"):
            state["corpus"] = self.corpus.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.doc, self.offset = int(state["doc"]), int(state["offset"])
        # without a saved corpus position a stream corpus reads forward from its start to the document: the
        # same documents, only slower
        if "corpus" in state and hasattr(self.corpus, "load_state_dict"):
            self.corpus.load_state_dict(state["corpus"])

    def _tokens(self) -> Tensor:
        return self.corpus.document(self.shard + self.doc * self.num_shards)

    def _round(self, n: int) -> int:
        return -(-n // self.pad_multiple) * self.pad_multiple

    def __iter__(self) -> DocumentPacker:
        return self

    def __next__(self) -> PackedBatch:
        rows: list[Tensor] = []
        lengths: list[int] = []
        padded: list[int] = []
        left = self.seq_len
        while left > 0:
            tokens = self._tokens()[self.offset:]
            if not self.split and lengths and self._round(len(tokens)) > left:
                padded[-1] += left  # close the batch: the last document takes the padding
                rows.append(torch.full((left,), self.pad_id, dtype=torch.long))
                break
            take = min(len(tokens), left)
            phys = min(self._round(take), left)
            rows += [tokens[:take], torch.full((phys - take,), self.pad_id, dtype=torch.long)]
            lengths.append(take)
            padded.append(phys)
            left -= phys
            if take == len(tokens):
                self.doc, self.offset = self.doc + 1, 0
            else:
                self.offset += take
        ids = torch.cat(rows)
        packed = PackedSeqs.from_lengths(lengths, padded)
        labels = future_tokens(ids, packed, self.label_depth)
        return PackedBatch(ids, labels, packed, lengths, padded)
