"""Token corpora addressed by document index, so a packer position (document, offset) is the whole data
state and resuming is exact.

* ``SyntheticCorpus`` (the default): documents drawn from a fixed sparse Markov chain (each token has three
  likely successors), and every other document repeats its first half, so there is structure for the
  MLP (bigrams) and for attention (copying) to learn. Deterministic in ``(seed, index)``; endless.
* ``TextCorpus``: byte-level tokens (vocabulary 256) of text files, one document per file or per paragraph.
  ``python_source_corpus()`` uses the Python standard library's own ``.py`` files, a text dataset that ships
  with every Python installation (no download).
* ``JsonlCorpus`` / ``ParquetCorpus``: the non-empty ``text_field`` values of the rows of JSON-lines or
  Parquet files, streamed in order (files as given, rows in file order, then the next epoch), tokenized
  with a local Hugging Face tokenizer (BOS / EOS around every document when the tokenizer has them) or as
  bytes. They cannot be indexed at random without reading everything before, so they read forward only and
  keep a position (epoch, file, row, byte offset, document index) that the packer saves with its own state:
  a resumed run seeks there directly instead of re-reading the stream.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor

from .errors import UserError

__all__ = ["Corpus", "SyntheticCorpus", "TextCorpus", "JsonlCorpus", "ParquetCorpus", "TokenEncoder",
           "load_tokenizer", "python_source_corpus", "build_corpus"]


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
        # the chain walks on Python ints: indexing a tensor once per token cost ~10 us a token, which made the
        # data, not the GPU, the bound of a step at 16k tokens
        self._next = self.successors.tolist()
        self._last: tuple[int, Tensor] | None = None  # the packer asks again for the rest of a split document

    def document(self, index: int) -> Tensor:
        if self._last is not None and self._last[0] == index:
            return self._last[1]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 1)
        length = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=g))
        choice = torch.multinomial(self.probs, length, replacement=True, generator=g).tolist()
        chain = [0, int(torch.randint(1, self.vocab_size, (1,), generator=g))]
        nxt = self._next
        for i in range(2, length):
            chain.append(nxt[chain[-1]][choice[i]])
        tokens = torch.tensor(chain[:length], dtype=torch.long)
        if index % 2 and length >= 4:  # copy task: second half repeats the first
            half = length // 2
            tokens[half:2 * half] = tokens[:half]
        self._last = (index, tokens)
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


def load_tokenizer(path: str) -> Any:
    """``transformers.AutoTokenizer`` from the local directory ``path`` (never a download)."""
    if not os.path.isdir(path):
        raise ValueError(f"--tokenizer {path!r} is not a directory: pass a local directory written by a tokenizer's "
                         "save_pretrained (tokenizer.json / tokenizer_config.json); csattn does not download "
                         "tokenizers")
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise UserError("--tokenizer needs the transformers package: pip install 'csattn[data]'") from e
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:  # no tokenizer files there, or files transformers cannot read
        raise ValueError(f"--tokenizer {path!r}: transformers could not load a tokenizer from this directory "
                         f"({e}); pass a directory written by a tokenizer's save_pretrained") from e


class TokenEncoder:
    """Text -> token ids: a Hugging Face tokenizer with its BOS / EOS around the document (when it defines
    them), or UTF-8 bytes (vocabulary 256, no BOS / EOS, like :class:`TextCorpus`) without one."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer) if tokenizer is not None else 256
        self.bos = getattr(tokenizer, "bos_token_id", None)
        self.eos = getattr(tokenizer, "eos_token_id", None)

    def __call__(self, text: str) -> Tensor:
        if self.tokenizer is None:
            return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
        # add_special_tokens=False: some tokenizers' post-processors add BOS / EOS, others not; adding them
        # here gives every tokenizer the same one BOS + text + EOS. verbose=False: documents are meant to be
        # longer than model_max_length (the packer cuts them), so the length warning is noise.
        ids = self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        ids = ([self.bos] if self.bos is not None else []) + list(ids) + ([self.eos] if self.eos is not None else [])
        return torch.tensor(ids, dtype=torch.long)


class _StreamCorpus:
    """Documents = rows of ``paths`` whose ``text_field`` is a non-empty string (other rows are skipped and
    take no document index), read forward only, endlessly (epoch after epoch, in the same order).

    ``document(index)`` returns the document at ``index`` of the stream (replica ``s`` of ``n`` asks for
    ``s, s + n, ...``; the rows in between are read but not tokenized). ``state_dict()`` is the position of
    the current document, so a corpus restored from it returns the same documents from there on.
    """

    kind = ""

    def __init__(self, paths: list[str], text_field: str = "text", tokenizer: Any = None) -> None:
        if not paths:
            raise ValueError(f"--data {self.kind} needs --data-path FILE [FILE ...] (the {self.kind} files to read)")
        for path in paths:
            if not os.path.isfile(path):
                raise ValueError(f"--data-path {path!r}: no such file")
        self.paths, self.text_field = list(paths), text_field
        self.encoder = TokenEncoder(tokenizer)
        self.vocab_size = self.encoder.vocab_size
        for path in self.paths:
            self._check_file(path)
        self._rows_iter: Iterator[tuple[int, int, int, Any]] | None = None
        self.load_state_dict({"epoch": 0, "file": 0, "row": 0, "byte": 0, "index": 0})

    # subclasses: the rows of one file from a position on
    def _check_file(self, path: str) -> None:
        pass

    def _rows(self, path: str, row: int, byte: int) -> Iterator[tuple[int, int, int, Any]]:
        """``(row, byte offset of the row, byte offset of the next row, text value)`` from ``row`` / ``byte``."""
        raise NotImplementedError

    def _where(self, pos: dict[str, int]) -> str:
        return f"{self.paths[pos['file']]} row {pos['row']}"

    def state_dict(self) -> dict[str, Any]:
        # the current document's row if there is one (re-read on resume: the packer may be inside it)
        pos = self._doc_pos if self._doc is not None else self._pos
        return {**pos, "index": self._doc_index if self._doc is not None else self._next_index,
                "path": self.paths[pos["file"]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        file = int(state["file"])
        if not 0 <= file < len(self.paths) or state.get("path", self.paths[file]) != self.paths[file]:
            raise ValueError(f"the saved data position is in file {state.get('path', file)!r}, which is not "
                             f"file {file} of --data-path {self.paths}: resume with the checkpoint's --data-path")
        if self._rows_iter is not None:
            self._rows_iter.close()  # closes its file now
        self._rows_iter = None
        self._pos = {"epoch": int(state["epoch"]), "file": file, "row": int(state["row"]), "byte": int(state["byte"])}
        self._next_index = int(state["index"])
        self._doc: Tensor | None = None
        self._doc_index, self._doc_pos = -1, dict(self._pos)
        self._wraps_without_doc = 0

    def _next_row(self) -> tuple[dict[str, int], Any]:
        """The next row's position and text value, moving on to the next file / epoch at a file's end."""
        while True:
            if self._rows_iter is None:
                self._rows_iter = self._rows(self.paths[self._pos["file"]], self._pos["row"], self._pos["byte"])
            item = next(self._rows_iter, None)
            if item is not None:
                row, byte, next_byte, value = item
                here = {**self._pos, "row": row, "byte": byte}
                self._pos.update(row=row + 1, byte=next_byte)
                return here, value
            self._rows_iter = None
            self._pos.update(file=self._pos["file"] + 1, row=0, byte=0)
            if self._pos["file"] == len(self.paths):
                self._pos.update(file=0, epoch=self._pos["epoch"] + 1)
                self._wraps_without_doc += 1
                if self._wraps_without_doc >= 2:  # a whole pass over every file found nothing
                    raise ValueError(f"--data-path {self.paths}: no row has a non-empty string in field "
                                     f"{self.text_field!r} (--text-field)")

    def document(self, index: int) -> Tensor:
        if self._doc is not None and index == self._doc_index:
            return self._doc  # the packer asks again for the document it is inside
        if index < self._next_index:
            raise ValueError(f"{type(self).__name__} reads forward only: document {index} was requested after "
                             f"document {self._next_index - 1}")
        while True:
            pos, value = self._next_row()
            if value is None or value == "":
                continue  # no document: takes no index
            if not isinstance(value, str):
                raise ValueError(f"{self._where(pos)}: field {self.text_field!r} (--text-field) is a "
                                 f"{type(value).__name__}, not a string")
            self._wraps_without_doc = 0
            i, self._next_index = self._next_index, self._next_index + 1
            if i == index:
                self._doc, self._doc_index, self._doc_pos = self.encoder(value), i, pos
                return self._doc


class JsonlCorpus(_StreamCorpus):
    """JSON lines (one object per line, blank lines skipped), read with the standard ``json`` module; the
    saved position holds the line's byte offset, so resuming seeks straight to it."""

    kind = "jsonl"

    def _where(self, pos: dict[str, int]) -> str:
        return f"{self.paths[pos['file']]} line {pos['row'] + 1}"

    def _rows(self, path: str, row: int, byte: int) -> Iterator[tuple[int, int, int, Any]]:
        with open(path, "rb") as f:
            f.seek(byte)
            while line := f.readline():
                start, byte, row = byte, byte + len(line), row + 1
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {row}: not valid JSON ({e.msg}); --data jsonl reads one JSON "
                                     "object per line") from e
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path} line {row}: not UTF-8 ({e.reason})") from e
                if not isinstance(obj, dict) or self.text_field not in obj:
                    keys = sorted(obj) if isinstance(obj, dict) else f"a JSON {type(obj).__name__}"
                    raise ValueError(f"{path} line {row}: no field {self.text_field!r} (its fields: {keys}); pass "
                                     "the field holding the text with --text-field")
                yield row - 1, start, byte, obj[self.text_field]


class ParquetCorpus(_StreamCorpus):
    """Parquet files read one row group at a time (only the text column), never a whole file in memory."""

    kind = "parquet"

    def __init__(self, paths: list[str], text_field: str = "text", tokenizer: Any = None) -> None:
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise UserError("--data parquet needs the pyarrow package: pip install 'csattn[data]'") from e
        self._pq = pq
        super().__init__(paths, text_field, tokenizer)

    def _check_file(self, path: str) -> None:
        import pyarrow as pa

        schema = self._pq.read_schema(path)  # the footer only
        if self.text_field not in schema.names:
            raise ValueError(f"{path}: no column {self.text_field!r} (its columns: {schema.names}); pass the column "
                             "holding the text with --text-field")
        kind = schema.field(self.text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(kind))):
            raise ValueError(f"{path}: column {self.text_field!r} (--text-field) has type {kind}, not a string")

    def _rows(self, path: str, row: int, byte: int) -> Iterator[tuple[int, int, int, Any]]:
        with self._pq.ParquetFile(path) as f:
            first = 0  # the first row of row group g
            for g in range(f.metadata.num_row_groups):
                n = f.metadata.row_group(g).num_rows
                if row < first + n:
                    values = f.read_row_group(g, columns=[self.text_field]).column(0).to_pylist()
                    for i in range(max(row - first, 0), n):
                        yield first + i, 0, 0, values[i]
                first += n


def build_corpus(name: str, vocab_size: int, seed: int, text_paths: list[str] | None = None,
                 min_len: int = 8, max_len: int = 96, data_paths: list[str] | None = None, text_field: str = "text",
                 tokenizer: Any = None) -> Corpus:
    """``"synthetic"``, ``"pysrc"`` (standard-library sources), ``"text"`` (``text_paths``), or ``"jsonl"`` /
    ``"parquet"`` (``data_paths``, ``text_field``, an optional loaded ``tokenizer``). ``vocab_size`` is the
    model's: the corpus's token ids must fit in it."""
    if tokenizer is not None and name not in ("jsonl", "parquet"):
        raise ValueError(f"--tokenizer applies to --data jsonl and parquet, not {name!r}")
    if name in ("jsonl", "parquet"):
        corpus: _StreamCorpus = (JsonlCorpus if name == "jsonl" else ParquetCorpus)(
            list(data_paths or []), text_field, tokenizer)
        if corpus.vocab_size > vocab_size:
            what = (f"the tokenizer has {corpus.vocab_size} tokens" if tokenizer is not None else
                    "byte-level text (no --tokenizer) has 256 token ids")
            raise ValueError(f"{what} but the model's vocab_size is {vocab_size}: token ids would exceed the "
                             "embedding. Use a model whose vocab_size covers the tokenizer (--init-from / "
                             "--config-json), or leave both out to build one from the tokenizer's size")
        return corpus
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
    raise ValueError(f"data must be synthetic, pysrc, text, jsonl or parquet, got {name!r}")
