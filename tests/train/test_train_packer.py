"""The document packer: cu_seqlens (real and padded), labels within documents, data-parallel shards, resume."""

import pytest
import torch

from csattn.train.data import SyntheticCorpus, TextCorpus
from csattn.train.packer import DocumentPacker


def _docs(corpus, indices):
    return [corpus.document(i) for i in indices]


@pytest.mark.parametrize("pad_multiple,split", [(1, True), (4, True), (8, False)], ids=["plain", "pad4", "nosplit"])
def test_batches_cover_the_stream(pad_multiple, split):
    corpus = SyntheticCorpus(64, seed=3, min_len=2, max_len=40)
    packer = DocumentPacker(corpus, seq_len=64, pad_multiple=pad_multiple, label_depth=2, split=split)
    real_rows = []
    for _ in range(6):
        b = next(packer)
        cu, cu_pad = b.packed.cu_seqlens.tolist(), b.packed.cu_seqlens_padded.tolist()
        assert cu_pad[-1] == 64 == b.input_ids.shape[0]
        for i, (n, p) in enumerate(zip(b.lengths, b.padded_lengths)):
            assert cu[i + 1] - cu[i] == n and cu_pad[i + 1] - cu_pad[i] == p
            assert 1 <= n <= p
            if split or i < len(b.lengths) - 1:
                assert p % pad_multiple == 0
        rows = b.packed.rows()
        real_rows.append(b.input_ids[rows.real])
        # labels: next token / the one after, inside the same document only
        for t in range(64):
            nxt = t + 1 < 64 and bool(rows.real[t]) and bool(rows.real[t + 1]) and rows.doc[t] == rows.doc[t + 1]
            assert int(b.labels[0, t]) == (int(b.input_ids[t + 1]) if nxt else -100)
            nxt2 = nxt and t + 2 < 64 and bool(rows.real[t + 2]) and rows.doc[t] == rows.doc[t + 2]
            assert int(b.labels[1, t]) == (int(b.input_ids[t + 2]) if nxt2 else -100)
    stream = torch.cat(real_rows)
    whole = torch.cat(_docs(corpus, range(packer.doc + 1)))
    assert torch.equal(stream, whole[: stream.numel()])  # nothing lost, nothing reordered


def test_resume_and_shards():
    corpus = SyntheticCorpus(64, seed=1)
    a = DocumentPacker(corpus, seq_len=48)
    next(a)
    state = a.state_dict()
    expected = [next(a) for _ in range(3)]
    b = DocumentPacker(corpus, seq_len=48)
    b.load_state_dict(state)
    for want in expected:
        got = next(b)
        assert torch.equal(got.input_ids, want.input_ids) and got.lengths == want.lengths
    s0 = DocumentPacker(corpus, seq_len=4096, shard=0, num_shards=2, split=False)
    s1 = DocumentPacker(corpus, seq_len=4096, shard=1, num_shards=2, split=False)
    b0, b1 = next(s0), next(s1)
    assert torch.equal(b0.input_ids[: b0.lengths[0]], corpus.document(0))
    assert torch.equal(b1.input_ids[: b1.lengths[0]], corpus.document(1))
    assert torch.equal(b0.input_ids[b0.padded_lengths[0]:][: b0.lengths[1]], corpus.document(2))


def test_text_corpus_and_bad_arguments(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("first paragraph\n\nsecond one\n\nthird")
    corpus = TextCorpus([str(path)], split_paragraphs=True)
    assert len(corpus) == 3 and corpus.vocab_size == 256
    assert sorted(bytes(corpus.document(i).tolist()) for i in range(3)) == [b"first paragraph", b"second one",
                                                                          b"third"]
    with pytest.raises(ValueError, match="seq_len"):
        DocumentPacker(corpus, seq_len=10, pad_multiple=4)
    with pytest.raises(ValueError, match="shard"):
        DocumentPacker(corpus, seq_len=8, shard=2, num_shards=2)
