"""A packed batch through the whole model equals running each document alone (fp64): logits of the LM head
and the MTP head on every real row, and every parameter gradient (summed over the documents)."""

import pytest
import torch

from csattn.models.deepseek_v4 import future_tokens
from csattn.packing import PackedSeqs
from tests.models.model_utils import tiny_model


@pytest.mark.parametrize("pattern", ["flash", "pro"])
def test_packed_equals_per_document(pattern, assert_close):
    model = tiny_model(pattern, seed=1, mtp=1).double()
    lengths, padded = [5, 37, 1, 23, 12], [8, 40, 4, 24, 12]  # shorter than r and W, cut blocks, padding
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 64, (n,), generator=g) for n in lengths]
    rows = [torch.cat([d, torch.zeros(p - n, dtype=torch.long)]) for d, n, p in zip(docs, lengths, padded)]
    packed = PackedSeqs.from_lengths(lengths, padded)
    ids = torch.cat(rows)
    labels = future_tokens(ids, packed, 2)
    ones = torch.ones(2)  # sum losses (not means) so the per-document losses add up to the packed one
    out = model(ids, packed=packed, labels=labels[0], mtp_labels=labels[1:], label_counts=ones)
    out.loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    total = torch.zeros(())
    starts = packed.cu_seqlens_padded.tolist()
    for b, doc in enumerate(docs):
        one = PackedSeqs.from_lengths([len(doc)])
        lab = future_tokens(doc, one, 2)
        o = model(doc, packed=one, labels=lab[0], mtp_labels=lab[1:], label_counts=ones)
        o.loss.backward()
        total = total + o.loss.detach()
        rows_b = slice(starts[b], starts[b] + len(doc))
        assert_close(out.logits[rows_b], o.logits, 1e-10, f"doc {b} logits")
        assert_close(out.mtp_logits[0][rows_b], o.mtp_logits[0], 1e-10, f"doc {b} MTP logits")
    assert_close(out.loss.detach(), total, 1e-10, "loss")
    for name, p in model.named_parameters():
        if name in packed_grads:
            assert_close(p.grad, packed_grads[name], 1e-9, f"grad {name}")
        else:
            assert p.grad is None or torch.count_nonzero(p.grad) == 0, name
    assert len(packed_grads) > 40


def test_padding_rows_change_nothing(assert_close):
    """Different padding of the same documents: identical real-row logits, padding rows get no loss."""
    model = tiny_model("mixed", seed=2).double()
    g = torch.Generator().manual_seed(1)
    lengths = [9, 14]
    docs = [torch.randint(0, 64, (n,), generator=g) for n in lengths]
    outs = []
    for padded in ([9, 14], [12, 20]):
        ids = torch.cat([torch.cat([d, torch.full((p - len(d),), 7)]) for d, p in zip(docs, padded)])
        packed = PackedSeqs.from_lengths(lengths, padded)
        labels = future_tokens(ids, packed, 1)[0]
        out = model(ids, packed=packed, labels=labels)
        real = packed.rows().real
        outs.append((out.logits[real], out.loss, int((labels != -100).sum())))
    assert_close(outs[1][0], outs[0][0], 1e-12, "real-row logits")
    assert_close(outs[1][1], outs[0][1], 1e-12, "loss")
    assert outs[0][2] == outs[1][2] == sum(n - 1 for n in lengths)


def test_bad_input_names_argument():
    model = tiny_model("mixed", seed=0)
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.full((5,), 64, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        model(torch.zeros(5, dtype=torch.long), labels=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="cu_seqlens_padded"):
        model(torch.zeros(5, dtype=torch.long), packed=PackedSeqs.from_lengths([3, 3]))


def test_packed_and_cp_reach_every_attention_layer(monkeypatch):
    """The model hands the same packed metadata and CP object to every attention layer, MTP included."""
    from csattn.layers import HybridAttention
    from csattn.layers.plan import LOCAL

    seen = []

    class FakeCP:  # one rank owning every row: plans as one process does, and records who asked
        rank, size, group = 0, 1, None

        def plan(self, x_local, packed_global, config):
            seen.append((config, packed_global, self))
            return LOCAL.plan(x_local, packed_global, config)

        def local_rows(self, packed, device=None):
            return torch.arange(packed.num_rows, device=device)

    model = tiny_model("flash", seed=3, mtp=1)
    packed = PackedSeqs.from_lengths([6, 10], [8, 12])
    ids = torch.randint(0, 64, (20,))
    labels = future_tokens(ids, packed, 2)
    cp = FakeCP()
    out = model(ids, packed=packed, cp=cp, labels=labels[0], mtp_labels=labels[1:], label_counts=torch.ones(2))
    layers = [m for m in model.modules() if isinstance(m, HybridAttention)]
    assert len(layers) == 5 and len(seen) == 5 and all(s[0] is layer.config for s, layer in zip(seen, layers))
    assert all(s[1] is packed and s[2] is cp for s in seen)
    ref = model(ids, packed=packed, labels=labels[0], mtp_labels=labels[1:], label_counts=torch.ones(2))
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    with pytest.raises(ValueError, match="mtp_labels"):
        model(ids, packed=packed, cp=cp, labels=labels[0], label_counts=torch.ones(2))


def test_bf16_training_dtype_keeps_fp32_modules(assert_close):
    """bf16 parameters except mHC, sinks, biases, norms and RoPE tables (HF's fp32 modules); close to fp32."""
    ref = tiny_model("flash", seed=4)
    model = tiny_model("flash", seed=4).to_training_dtype(torch.bfloat16)
    dtypes = {n: p.dtype for n, p in list(model.named_parameters()) + list(model.named_buffers())}
    assert dtypes["model.layers.2.self_attn.q_b_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.2.mlp.experts.gate_up_proj"] == torch.bfloat16
    for name in ("model.layers.2.attn_hc.fn", "model.hc_head.hc_fn", "model.layers.2.self_attn.sinks",
                 "model.layers.2.self_attn.compressor.position_bias", "model.layers.3.mlp.gate.e_score_correction_bias",
                 "model.layers.2.input_layernorm.weight", "model.norm.weight", "model.layers.2.self_attn.inv_freq"):
        assert dtypes[name] == torch.float32, name
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(3))
    out = model(ids, labels=ids.roll(-1))
    out.loss.backward()
    assert_close(out.logits.float(), ref(ids).logits, 0.1, "bf16 logits")
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_chunked_loss_equals_full_logits_loss(assert_close):
    """Without returned logits the loss runs over recomputed row chunks: same loss, same gradients."""
    model = tiny_model("flash", seed=5, mtp=1).double()
    model.loss_chunk_rows = 7
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(4))
    packed = PackedSeqs.from_lengths([15, 25])
    labels = future_tokens(ids, packed, 2)
    full = model(ids, packed=packed, labels=labels[0], mtp_labels=labels[1:])
    full.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    chunked = model(ids, packed=packed, labels=labels[0], mtp_labels=labels[1:], return_logits=False)
    chunked.loss.backward()
    assert chunked.logits is None and chunked.mtp_logits == []
    assert_close(chunked.loss, full.loss, 1e-13, "loss")
    for n, p in model.named_parameters():
        if n in grads:
            assert_close(p.grad, grads[n], 1e-12, f"grad {n}")


def test_block_recompute_changes_nothing():
    """Blocks recomputed in the backward: bitwise the same loss and gradients (indexer loss included)."""
    ids = torch.randint(0, 64, (36,), generator=torch.Generator().manual_seed(5))
    packed = PackedSeqs.from_lengths([20, 16])
    labels = future_tokens(ids, packed, 2)
    runs = []
    for recompute in ("none", "block"):
        model = tiny_model("pro", seed=6, mtp=1, indexer_loss_coeff=0.5, recompute=recompute).double()
        assert model.config.recompute == recompute
        out = model(ids, packed=packed, labels=labels[0], mtp_labels=labels[1:])
        out.loss.backward()
        runs.append((out.loss.detach(), out.indexer_loss, {n: p.grad.clone() for n, p in model.named_parameters()
                                                           if p.grad is not None}))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert runs[0][2].keys() == runs[1][2].keys()
    for name, grad in runs[0][2].items():
        assert torch.equal(grad, runs[1][2][name]), name


@pytest.mark.parametrize("recompute", ["none", "block"])
def test_indexer_loss_scale_reaches_every_csa_layer(recompute):
    """``indexer_loss_scale`` scales exactly the gradient of the indexer loss: the parameters only it trains get
    ``scale`` times theirs (decoder and MTP blocks, blocks recomputed or not; a 0-d tensor the same bits as the
    number), every other gradient stays the same bits."""
    ids = torch.randint(0, 64, (36,), generator=torch.Generator().manual_seed(5))
    packed = PackedSeqs.from_lengths([20, 16])
    labels = future_tokens(ids, packed, 2)
    runs = []
    for scale in (1.0, 0.25, torch.tensor(0.25)):
        model = tiny_model("pro", seed=6, mtp=1, indexer_loss_coeff=0.5, recompute=recompute,
                           mtp_layer_types=["compressed_sparse_attention"]).double()
        out = model(ids, packed=packed, labels=labels[0], mtp_labels=labels[1:], indexer_loss_scale=scale)
        out.loss.backward()
        runs.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    indexer = [n for n in runs[0] if ".indexer." in n and "q_b_proj" in n]
    assert indexer and any(n.startswith("mtp.") for n in indexer)
    for name, grad in runs[0].items():
        assert torch.equal(runs[1][name], runs[2][name]), name
        if name in indexer:
            assert torch.count_nonzero(grad) > 0, name
            torch.testing.assert_close(runs[1][name], 0.25 * grad, rtol=1e-12, atol=0)
        elif ".indexer." not in name:
            assert torch.equal(runs[1][name], grad), name
