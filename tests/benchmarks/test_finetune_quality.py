"""``benchmarks.finetune_quality`` in small: the standard library's docstrings as a deterministic corpus, a byte-level
BPE trained on them and saved as an HF tokenizer, ``csattn train --data jsonl --tokenizer`` on the tiny model, the
loss logged, plotted and falling."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import finetune_quality as fq

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

TRAIN = ["--device", "cpu", "--seq-len", "64", "--steps", "12", "--lr", "3e-3", "--warmup-steps", "1",
         "--doc-min-len", "16", "--doc-max-len", "64", "--log-every", "4"]


def _trainer_flags() -> set[str]:
    from csattn.train.cli import add_train_args

    p = argparse.ArgumentParser()
    add_train_args(p)
    return {s for a in p._actions for s in a.option_strings}


def test_corpus_is_deterministic_english_prose():
    docs, meta = fq.docstring_documents(max_docs=20)
    again, meta2 = fq.docstring_documents(max_docs=20)
    assert docs == again and meta == meta2 and meta["documents"] == 20
    assert all(len(d) >= 200 for d in docs) and sum(" the " in d for d in docs) >= 15


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_tiny_run_loss_falls(tmp_path, lora):
    extra = ["--lora-rank", "8", "--lora-targets", "attention,shared_experts,experts"] if lora else []
    if lora and "--lora-rank" not in _trainer_flags():
        pytest.skip("csattn train has no --lora-rank in this tree")
    rc = fq.main(["--out", str(tmp_path), "--vocab", "320", "--max-docs", "40", "--", *TRAIN, *extra])
    out = json.loads((tmp_path / "quality.json").read_text())
    assert rc == 0 and out["rc"] == 0 and out["steps"] == 12 and out["tokenizer_vocab"] == 320
    assert out["fell"] and out["last_mean"] < out["first_mean"]
    assert (tmp_path / "loss.png").stat().st_size > 0 and (tmp_path / "tokenizer" / "tokenizer.json").exists()
    assert out["corpus"]["documents"] == 40 and len(out["corpus"]["sha256"]) == 64
