"""``csattn train`` on files: JSON lines and Parquet documents (a local tokenizer with BOS / EOS, or bytes),
packed into ``cu_seqlens``, resumed exactly from the saved read position; and its metrics: TensorBoard event
files and ``loss.png``."""

from __future__ import annotations

import json
import os

import pytest
import torch

from csattn.train.data import JsonlCorpus, ParquetCorpus, TokenEncoder, build_corpus, load_tokenizer
from csattn.train.metrics import loss_history
from csattn.train.packer import DocumentPacker
from csattn.train.run import TrainConfig, train
from tests.models.model_utils import tiny_config_dict

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")


SMALL = dict(seq_len=32, device="cpu", progress=False, warmup_steps=1)

SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "the quick brown fox jumps over the lazy dog",
             "birds sing in the morning", "we read a book by the river", "rain fell on the old town"]


def _texts(n: int) -> list[str]:
    """``n`` documents of 1 to 6 sentences (deterministic): some fit a 32-row batch, some are cut."""
    return [" ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(1 + (i * 5) % 6)) for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """A WordLevel tokenizer trained on the sentences, saved as transformers saves one, with BOS / EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "<s>", "</s>"]))
    path = str(tmp_path_factory.mktemp("tokenizer"))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]",
                            pad_token="[PAD]").save_pretrained(path)
    return path


def _write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps(row) + "\n")
            if i == 1:
                f.write("\n")  # a blank line is no row
    return path


def _write_parquet(path: str, texts: list[str | None], row_group_size: int = 3) -> str:
    pq.write_table(pa.table({"id": list(range(len(texts))), "body": texts}), path, row_group_size=row_group_size)
    return path


@pytest.fixture
def files(tmp_path) -> dict[str, list[str]]:
    """The same 24 documents (plus empty / null rows, which are skipped) as JSON lines and as Parquet, each in
    two files; the first holds two documents, so that two 32-row steps end inside the second."""
    texts = _texts(24)
    rows = [{"text": t} for t in texts]
    rows[2:2] = [{"text": ""}, {"text": None}]
    jsonl = [_write_jsonl(str(tmp_path / "a.jsonl"), rows[:4]), _write_jsonl(str(tmp_path / "b.jsonl"), rows[4:])]
    cells: list[str | None] = list(texts)
    cells[2:2] = ["", None]
    parquet = [_write_parquet(str(tmp_path / "a.parquet"), cells[:4]),
               _write_parquet(str(tmp_path / "b.parquet"), cells[4:])]
    return {"jsonl": jsonl, "parquet": parquet, "texts": texts}


def _expected_ids(tokenizer_dir: str, text: str) -> list[int]:
    """BOS + the tokenizer's word ids + EOS, looked up in the saved vocabulary (not through the encoder)."""
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        vocab = json.load(f)["model"]["vocab"]
    return [vocab["<s>"]] + [vocab[w] for w in text.split()] + [vocab["</s>"]]


def _corpus(kind: str, paths: list[str], tokenizer=None) -> JsonlCorpus | ParquetCorpus:
    return JsonlCorpus(paths, "text", tokenizer) if kind == "jsonl" else ParquetCorpus(paths, "body", tokenizer)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_documents_are_tokenized_with_bos_and_eos(kind, files, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    corpus = _corpus(kind, files[kind], tok)
    texts = files["texts"]
    assert corpus.vocab_size == len(tok)
    got = [corpus.document(i).tolist() for i in range(len(texts) + 3)]  # past the end: the next epoch
    want = [_expected_ids(tokenizer_dir, t) for t in texts]
    assert got == want + want[:3]
    assert all(d[0] == tok.bos_token_id and d[-1] == tok.eos_token_id for d in got)
    # without a tokenizer: the UTF-8 bytes, no BOS / EOS
    raw = _corpus(kind, files[kind])
    assert raw.vocab_size == 256
    assert [raw.document(i).tolist() for i in range(len(texts))] == [list(t.encode()) for t in texts]


def test_tokenizer_without_bos_or_eos_adds_none(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(tmp_path / "tok"))
    encoder = TokenEncoder(load_tokenizer(str(tmp_path / "tok")))
    assert encoder("the cat").tolist() == [tok.token_to_id("the"), tok.token_to_id("cat")]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_packing_and_data_parallel_shards(kind, files, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    want = [_expected_ids(tokenizer_dir, t) for t in files["texts"]]
    packer = DocumentPacker(_corpus(kind, files[kind], tok), seq_len=32, pad_multiple=4, label_depth=2)
    stream: list[int] = []
    for _ in range(6):
        batch = next(packer)
        assert batch.input_ids.shape == (32,) and batch.labels.shape == (2, 32)
        cu, cu_pad = batch.packed.cu_seqlens.tolist(), batch.packed.cu_seqlens_padded.tolist()
        assert cu[-1] == sum(batch.lengths) and cu_pad[-1] == 32
        for start, n in zip(cu_pad[:-1], batch.lengths):  # each piece is real tokens, then padding
            stream += batch.input_ids[start:start + n].tolist()
    flat = [t for d in want for t in d]
    assert stream == flat[:len(stream)] and len(stream) > len(want[0]) + len(want[1])
    # replica s of 2 reads documents s, s + 2, ...
    for shard in (0, 1):
        p = DocumentPacker(_corpus(kind, files[kind], tok), seq_len=4096, shard=shard, num_shards=2, split=False)
        batch = next(p)
        got = [batch.input_ids[a:a + n].tolist() for a, n in zip(batch.packed.cu_seqlens_padded.tolist(),
                                                                  batch.lengths)]
        assert got[:5] == want[shard::2][:5]


def test_restored_jsonl_position_seeks_without_rereading(files, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    first = JsonlCorpus(files["jsonl"], "text", tok)
    for i in range(8):
        first.document(i)
    state = first.state_dict()
    assert state["file"] == 1 and state["byte"] > 0 and state["index"] == 7
    # everything before the saved offset becomes invalid JSON of the same length: a corpus that re-read the
    # stream from its start would fail on it
    path = files["jsonl"][1]
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(b"x" * state["byte"] + data[state["byte"]:])
    again = JsonlCorpus(files["jsonl"], "text", tok)
    again.load_state_dict(state)
    want = [_expected_ids(tokenizer_dir, t) for t in files["texts"]]
    assert [again.document(i).tolist() for i in (7, 8, 9)] == want[7:10]
    with pytest.raises(ValueError, match=r"b\.jsonl line 1: not valid JSON"):
        JsonlCorpus(files["jsonl"], "text", tok).document(6)


def test_restored_parquet_position_reads_one_row_group(files, tokenizer_dir, monkeypatch):
    tok = load_tokenizer(tokenizer_dir)
    first = ParquetCorpus(files["parquet"], "body", tok)
    for i in range(12):
        first.document(i)
    state = first.state_dict()
    assert state["file"] == 1 and state["row"] == 9  # document 11 = row 9 of b.parquet (2 + 10): row group 3
    groups: list[int] = []
    read = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, i, *a, **k: groups.append(i) or read(
        self, i, *a, **k))
    again = ParquetCorpus(files["parquet"], "body", tok)
    again.load_state_dict(state)
    want = [_expected_ids(tokenizer_dir, t) for t in files["texts"]]
    assert again.document(11).tolist() == want[11] and groups == [3]
    assert again.document(12).tolist() == want[12]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_run_and_exact_resume(kind, files, tokenizer_dir, tmp_path):
    data = dict(data=kind, data_path=files[kind], tokenizer=tokenizer_dir,
                text_field="text" if kind == "jsonl" else "body", **SMALL)
    out = str(tmp_path / "run")
    full = train(TrainConfig(steps=4, output=out, save_every=2, **data))
    assert all(torch.isfinite(torch.tensor(full.losses))) and len(full.losses) == 4
    tok = load_tokenizer(tokenizer_dir)
    assert full.model.config.vocab_size == len(tok)  # from scratch: the tokenizer's vocabulary
    from csattn.train.checkpoint.safe_state import load_state

    state = load_state(os.path.join(out, "checkpoint-000002", "trainer_state.safetensors"))
    corpus_pos = state["packers"][0]["corpus"]
    assert corpus_pos["file"] == 1 and corpus_pos["path"] == files[kind][1]  # inside the second file
    resumed = train(TrainConfig(steps=4, resume=os.path.join(out, "checkpoint-000002"), **data))
    assert resumed.start_step == 2
    assert resumed.losses == full.losses[2:]  # bitwise
    a, b = full.model.state_dict(), resumed.model.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_byte_level_run_and_resume_refuses_other_data(files, tokenizer_dir, tmp_path):
    out = str(tmp_path / "run")
    data = dict(data="jsonl", data_path=files["jsonl"], **SMALL)
    result = train(TrainConfig(steps=2, output=out, save_every=1, **data))
    assert result.model.config.vocab_size == 256 and all(torch.isfinite(torch.tensor(result.losses)))
    ckpt = os.path.join(out, "checkpoint-000001")
    with pytest.raises(ValueError, match=r"--data-path \[.*b\.jsonl'\] \(checkpoint: \[.*a\.jsonl', .*--init-from"):
        train(TrainConfig(steps=2, resume=ckpt, **{**data, "data_path": files["jsonl"][1:]}))
    with pytest.raises(ValueError, match=r"--text-field 'body' \(checkpoint: 'text'\)"):
        train(TrainConfig(steps=2, resume=ckpt, **{**data, "text_field": "body"}))
    with pytest.raises(ValueError, match=r"--tokenizer '.*' \(checkpoint: None\)"):
        train(TrainConfig(steps=2, resume=ckpt, **{**data, "tokenizer": tokenizer_dir}))


def test_errors_name_the_option(files, tokenizer_dir, tmp_path):
    tok = load_tokenizer(tokenizer_dir)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_config_dict("flash", vocab=len(tok) - 1)))
    with pytest.raises(ValueError, match=rf"tokenizer has {len(tok)} tokens but the model's vocab_size is "
                                         rf"{len(tok) - 1}.*--init-from / --config-json"):
        train(TrainConfig(steps=1, data="jsonl", data_path=files["jsonl"], tokenizer=tokenizer_dir,
                          config_json=str(config), **SMALL))
    with pytest.raises(ValueError, match=r"--tokenizer '.*nowhere' is not a directory"):
        load_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"--tokenizer '.*': transformers could not load"):
        load_tokenizer(str(tmp_path))  # a directory without tokenizer files
    with pytest.raises(ValueError, match=r"--data jsonl needs --data-path"):
        build_corpus("jsonl", 256, 0)
    with pytest.raises(ValueError, match=r"--data-path '.*missing\.parquet': no such file"):
        build_corpus("parquet", 256, 0, data_paths=[str(tmp_path / "missing.parquet")])
    with pytest.raises(ValueError, match=r"a\.parquet: no column 'text' \(its columns: \['id', 'body'\]\).*--text"):
        build_corpus("parquet", 256, 0, data_paths=files["parquet"])
    with pytest.raises(ValueError, match=r"column 'id' \(--text-field\) has type int64, not a string"):
        build_corpus("parquet", 256, 0, data_paths=files["parquet"], text_field="id")
    with pytest.raises(ValueError, match=r"a\.jsonl line 1: no field 'body' \(its fields: \['text'\]\).*--text-field"):
        build_corpus("jsonl", 256, 0, data_paths=files["jsonl"], text_field="body").document(0)
    with pytest.raises(ValueError, match=r"byte-level text .* vocab_size is 100"):
        build_corpus("jsonl", 100, 0, data_paths=files["jsonl"])
    empty = _write_jsonl(str(tmp_path / "empty.jsonl"), [{"text": ""}, {"text": None}])
    with pytest.raises(ValueError, match=r"no row has a non-empty string in field 'text'"):
        build_corpus("jsonl", 256, 0, data_paths=[empty]).document(0)
    with pytest.raises(ValueError, match=r"--tokenizer applies to --data jsonl / parquet, not --data synthetic"):
        train(TrainConfig(steps=1, tokenizer=tokenizer_dir, **SMALL))
    with pytest.raises(ValueError, match=r"--data-path is read by --data jsonl / parquet, not --data text"):
        train(TrainConfig(steps=1, data="text", data_path=files["jsonl"], **SMALL))


def test_tensorboard_events_metrics_and_loss_png(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, logs = str(tmp_path / "run"), str(tmp_path / "tb")
    cfg = dict(output=out, log_dir=logs, peak_tflops=1.0, **SMALL)
    full = train(TrainConfig(steps=4, save_every=2, **cfg))
    os.remove(os.path.join(logs, "loss.png"))
    # resume at step 2: steps 3 and 4 are run again; TensorBoard keeps only the new ones (purge_step)
    resumed = train(TrainConfig(steps=4, resume=os.path.join(out, "checkpoint-000002"), **cfg))
    assert len([n for n in os.listdir(logs) if n.startswith("events.out.tfevents")]) == 2
    acc = EventAccumulator(logs)
    acc.Reload()
    tags = {"loss/total", "loss/lm", "loss/mtp", "loss/indexer", "optim/lr", "optim/grad_norm", "perf/tokens_per_s",
            "perf/mfu"}
    assert tags <= set(acc.Tags()["scalars"])
    for tag in tags:
        assert [e.step for e in acc.Scalars(tag)] == [1, 2, 3, 4], tag
    logged = [e.value for e in acc.Scalars("loss/total")]
    want = full.losses[:2] + resumed.losses
    assert logged == pytest.approx(want, rel=1e-6)  # event files store float32
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert all(r["grad_norm"] > 0 and r["mtp_loss"] > 0 and r["mfu"] > 0 for r in records)
    # loss.png, written again by the resumed run, plots the whole history: the metrics file's steps 1-4
    steps, series = loss_history(TrainConfig(steps=4, **cfg), 2, resumed.losses, resumed.lm_losses,
                                 resumed.indexer_losses)
    assert steps == [1, 2, 3, 4] and series["loss"] == full.losses
    import matplotlib.pyplot as plt

    with open(os.path.join(logs, "loss.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    image = plt.imread(os.path.join(logs, "loss.png"))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0


def test_grad_norm_is_recorded_with_and_without_clipping(tmp_path):
    norms = {}
    for clip in (0.0, 1e9):  # 1e9: clip_grad_norm_ runs but never scales
        path = str(tmp_path / f"m{clip}.jsonl")
        train(TrainConfig(steps=2, grad_clip=clip, metrics=path, **SMALL))
        with open(path) as f:
            norms[clip] = [json.loads(line)["grad_norm"] for line in f]
    assert norms[0.0] == pytest.approx(norms[1e9], rel=1e-6) and all(n > 0 for n in norms[0.0])


def test_checkpoint_holds_the_tokenizer_and_its_special_ids(files, tokenizer_dir, tmp_path):
    """The saved checkpoint decodes and generates on its own: the tokenizer's files next to config.json, whose
    BOS / EOS / PAD ids are the tokenizer's (not the model config's defaults 0 / 1 / None)."""
    out = str(tmp_path / "run")
    train(TrainConfig(steps=2, output=out, data="jsonl", data_path=files["jsonl"], tokenizer=tokenizer_dir, **SMALL))
    saved = os.path.join(out, "checkpoint-000002")
    tok, again = load_tokenizer(tokenizer_dir), load_tokenizer(saved)
    assert "tokenizer.json" in os.listdir(saved) and again.get_vocab() == tok.get_vocab()
    with open(os.path.join(saved, "config.json")) as f:
        config = json.load(f)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == \
        (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (2, 3, 0)
