"""HF-format checkpoints: made by ``transformers`` itself, read by us; written by us, read by ``transformers``;
mismatches fail with an error naming the tensor."""

import json
import os

import pytest
import torch

from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig, load_pretrained
from csattn.packing import PackedSeqs
from tests.models.model_utils import tiny_config_dict, tiny_model


def _ids(n=30, vocab=64, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_load_checkpoint_saved_by_transformers(tmp_path, assert_close):
    pytest.importorskip("transformers")
    from tests.models.model_utils import hf_model

    cfg = tiny_config_dict("flash", mtp=1)  # HF does not build MTP: the checkpoint has no mtp.* tensors
    hf = hf_model(cfg, seed=4)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(str(tmp_path))
    assert len(ours.mtp) == 0  # built only when the checkpoint has them (mtp=None)
    ids = _ids()
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
        got = ours(ids).logits
    assert_close(got, ref, 1e-5, "logits")
    with pytest.warns(UserWarning, match="fresh weights"):
        with_mtp = load_pretrained(str(tmp_path), mtp=True)
    assert len(with_mtp.mtp) == 1


def test_transformers_loads_our_checkpoint(tmp_path, assert_close):
    pytest.importorskip("transformers")
    from transformers import DeepseekV4ForCausalLM as HFModel

    ours = tiny_model("pro", seed=5, mtp=1, tie=True)
    ours.save_pretrained(str(tmp_path))
    hf = HFModel.from_pretrained(str(tmp_path), dtype=torch.float32)
    hf.config._experts_implementation = "eager"
    ids = _ids(seed=1)
    with torch.no_grad():
        assert_close(ours(ids).logits, hf(input_ids=ids[None]).logits[0], 1e-5, "logits")


def test_save_load_roundtrip_keeps_every_tensor(tmp_path):
    ours = tiny_model("mixed", seed=6, mtp=1)
    ours.save_pretrained(str(tmp_path))
    back = DeepseekV4ForCausalLM.from_pretrained(str(tmp_path))
    assert len(back.mtp) == 1
    a, b = ours.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ids = _ids(seed=2)
    packed = PackedSeqs.from_lengths([10, 20])
    assert torch.equal(ours(ids, packed=packed).logits, back(ids, packed=packed).logits)


def test_mismatched_checkpoints_name_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    ours = tiny_model("flash", seed=7)
    ours.save_pretrained(str(tmp_path))
    weights = os.path.join(tmp_path, "model.safetensors")
    config = os.path.join(tmp_path, "config.json")
    tensors = load_file(weights)

    # the config says something else than the tensors: a wider MoE
    with open(config) as f:
        raw = json.load(f)
    with open(config, "w") as f:
        json.dump({**raw, "moe_intermediate_size": 24}, f)
    with pytest.raises(ValueError, match=r"mlp\.(shared_experts|experts)\..*has shape"):
        load_pretrained(str(tmp_path))
    with open(config, "w") as f:
        json.dump(raw, f)

    # a missing expert matrix
    experts = {k: v for k, v in tensors.items() if k != "model.layers.3.ffn.experts.2.w3.weight"}
    save_file(experts, weights)
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.experts\.2\.w3"):
        load_pretrained(str(tmp_path))

    # a missing tensor
    missing = dict(tensors)
    del missing["model.layers.2.attn.indexer.wq_b.weight"]  # on-disk (reference) name
    save_file(missing, weights)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.compressor\.indexer\.q_b_proj\.weight"):
        load_pretrained(str(tmp_path))

    # a misshaped tensor
    bad = dict(tensors)
    bad["model.layers.1.hc_attn_fn"] = bad["model.layers.1.hc_attn_fn"][:, :-1].contiguous()
    save_file(bad, weights)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.attn_hc\.fn.*model\.layers\.1\.hc_attn_fn"):
        load_pretrained(str(tmp_path))

    # an unexpected tensor (config with fewer layers than the checkpoint)
    save_file(tensors, weights)
    with open(config, "w") as f:
        json.dump({**raw, "num_hidden_layers": 3, "layer_types": raw["layer_types"][:3],
                   "mlp_layer_types": raw["mlp_layer_types"][:3]}, f)
    with pytest.raises(ValueError, match=r"model\.layers\.3\."):
        load_pretrained(str(tmp_path))


def test_config_roundtrip_and_validation():
    cfg = DeepseekV4ModelConfig.from_hf(tiny_config_dict("pro", mtp=1))
    again = DeepseekV4ModelConfig.from_hf(cfg.to_hf_dict())
    assert again.to_hf_dict() == cfg.to_hf_dict()
    legacy = DeepseekV4ModelConfig.from_hf({**tiny_config_dict("pro", mtp=1), "layer_types": None,
                                            "compress_ratios": [0, 4, 128, 4, 4], "mlp_layer_types": None,
                                            "num_hash_layers": 1})
    assert legacy.layer_types == ["sliding_attention", "compressed_sparse_attention",
                                  "heavily_compressed_attention", "compressed_sparse_attention"]
    assert legacy.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"]
    assert legacy.mtp_layer_types == ["compressed_sparse_attention"]  # the entry past the decoder
    assert DeepseekV4ForCausalLM(legacy).mtp[0].self_attn.config.layer_type == "csa"
    pytest.importorskip("transformers")
    from transformers import DeepseekV4Config

    fields = {k: v for k, v in tiny_config_dict("flash").items() if k != "model_type"}
    from_object = DeepseekV4ModelConfig.from_hf(DeepseekV4Config(**fields))
    assert from_object.to_hf_dict() == DeepseekV4ModelConfig.from_hf(tiny_config_dict("flash")).to_hf_dict()
    with pytest.raises(ValueError, match="mlp_layer_types"):
        DeepseekV4ModelConfig.from_hf({**tiny_config_dict("pro"), "mlp_layer_types": ["moe"]})
    with pytest.raises(ValueError, match="model_type"):
        DeepseekV4ModelConfig.from_hf({"model_type": "llama"})


@pytest.mark.parametrize("field,value", [("index_topk", 1.5), ("num_experts_per_tok", 2.0), ("hc_mult", 4.5),
                                         ("vocab_size", 64.0), ("moe_chunk_rows", True)])
def test_config_refuses_non_integer_sizes(field, value):
    with pytest.raises(ValueError, match=f"{field} must be an int, got {value!r}"):
        DeepseekV4ModelConfig.from_hf({**tiny_config_dict("flash"), field: value})


def _saved(tmp_path, **edits):
    """A saved tiny model (hash-routed first layers) with ``edits``: on-disk name -> new tensor."""
    from safetensors.torch import load_file, save_file

    tiny_model("flash", seed=6).save_pretrained(str(tmp_path))
    weights = os.path.join(tmp_path, "model.safetensors")
    if edits:
        tensors = load_file(weights)
        for key, fn in edits.items():
            tensors[key] = fn(tensors[key])
        save_file(tensors, weights, metadata={"format": "pt"})
    return weights


@pytest.mark.parametrize("keep", [0.5, 100], ids=["data_cut", "header_cut"])
def test_truncated_file_names_the_file(tmp_path, keep):
    from csattn.models.deepseek_v4.checkpoint import read_safetensors

    weights = _saved(tmp_path)
    with open(weights, "rb") as f:
        data = f.read()
    with open(weights, "wb") as f:
        f.write(data[: int(len(data) * keep) if keep < 1 else keep])
    for load in (load_pretrained, read_safetensors):  # the loader, and the resume path's reader
        with pytest.raises(ValueError, match=r"cannot read '.*model\.safetensors'.*truncated or damaged"):
            load(str(tmp_path))


@pytest.mark.parametrize("key,damage,match,resume_match", [
    # a damaged hash-routing table used to load and then index past the experts deep inside the MoE
    ("model.layers.0.ffn.gate.tid2eid", lambda t: torch.full_like(t, 7272736067030267744),
     r"hash-routing table 'model\.layers\.0\.mlp\.gate\.tid2eid' \('model\.layers\.0\.ffn\.gate\.tid2eid' in "
     r"'model\.safetensors'\) holds expert ids in \[7272736067030267744, 7272736067030267744\] but the model has 4",
     r"hash-routing table 'model\.layers\.0\.mlp\.gate\.tid2eid' .* holds expert ids in \[7272736067030267744"),
    ("model.layers.1.ffn.gate.tid2eid", lambda t: t - 1, r"tid2eid.*holds expert ids in \[-1, ",
     r"tid2eid.*holds expert ids in \[-1, "),
    ("model.layers.1.ffn.gate.tid2eid", lambda t: t.float(),
     r"tid2eid.*is torch\.float32 on disk but the model holds torch\.int64",
     r"tid2eid.*is torch\.float32 on disk but the model holds torch\.int64"),
    ("model.layers.2.attn.wq_b.weight", lambda t: t.index_fill(0, torch.tensor([3]), float("nan")),
     r"tensor 'model\.layers\.2\.self_attn\.q_b_proj\.weight' \('model\.layers\.2\.attn\.wq_b\.weight' in "
     r"'model\.safetensors'\) holds 24 non-finite values",
     r"tensor 'model\.layers\.2\.self_attn\.q_b_proj\.weight' .* holds 24 non-finite values"),
    ("model.layers.3.ffn.experts.1.w2.weight", lambda t: t.index_fill(1, torch.tensor([0]), float("inf")),
     r"'model\.layers\.3\.mlp\.experts\.1\.w2\.weight' .* holds 32 non-finite values",
     r"'model\.layers\.3\.mlp\.experts\.down_proj' .* holds 32 non-finite values"),
], ids=["hash_table_garbage", "hash_table_negative", "hash_table_float", "nan_weight", "inf_expert"])
def test_damaged_tensor_is_named_on_load(tmp_path, key, damage, match, resume_match):
    from safetensors.torch import load_file

    from csattn.models.deepseek_v4.checkpoint import load_state_dict_into, read_safetensors

    assert key in load_file(_saved(tmp_path))  # an on-disk name of the tiny model
    _saved(tmp_path, **{key: damage})
    with pytest.raises(ValueError, match=match):
        load_pretrained(str(tmp_path))
    # the resume path (read_safetensors + load_state_dict_into) checks the same
    with pytest.raises(ValueError, match=resume_match):
        load_state_dict_into(tiny_model("flash", seed=6), read_safetensors(str(tmp_path)))
