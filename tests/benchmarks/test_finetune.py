"""``benchmarks.finetune`` on the CPU with a tiny geometry (reference backends): the release-format checkpoint
written once and reused, the bf16 copy of the FP8-held experts equal to a bf16 load, a step per mode recorded (or
its error) beside the planner, the JSON the page's "Fine-tuning" section renders (and the page without it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import finetune as ft
from csattn.models.deepseek_v4.checkpoint import load_pretrained
from tests.models.model_utils import tiny_config_dict

pytest.importorskip("matplotlib")

META = {"commit": "abc1234", "torch": "2.11.0", "triton": "3.6.0", "device": "NVIDIA H200",
        "date": "2026-12-04 10:00:00 UTC"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A 4-layer geometry (W, W, CSA, HCA) whose experts take 128x128 FP8 blocks: D 64, I 128, 8 experts."""
    raw = tiny_config_dict("flash", mtp=0)
    raw.update(hidden_size=64, moe_intermediate_size=128, n_routed_experts=8)
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.slow
def test_harness_end_to_end(tmp_path, tiny):
    ckpt, out = tmp_path / "ckpt", tmp_path / "finetune.json"
    argv = ["--ckpt", str(ckpt), "--json", str(out), "--config", str(tiny), "--parts", "steps,logits",
            "--modes", "c,d", "--tokens", "64", "--steps", "1", "--logits-tokens", "64", "--device", "cpu",
            "--commit", "abc1234"]
    assert ft.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["commit"] == "abc1234" and not data["checkpoint"]["reused"]
    assert (ckpt / "model.safetensors.index.json").exists()
    assert data["logits"]["tokens"] == 64 and data["logits"]["rel_l2"] >= 0.0
    by = {r["mode"]: r for r in data["results"]}
    d = by["d"]
    assert d["tokens"] == 64 and d["ms"] > 0 and len(d["losses"]) == 2 and all(map(float, d["losses"]))
    assert d["planned_gib"] > 0 and d["weights_gib"]["experts"] > 0
    assert d["weights_gib"]["trained_params"] == sum(p.numel() for p in load_pretrained(str(ckpt)).parameters()
                                                     if p.is_floating_point())
    assert d["flops"]["fp8"] == 0 and d["tflops"] > 0
    # mode (c) needs LoRA (csattn.finetune): measured, or its error recorded, never a crash
    assert by["c"].get("ms") or by["c"].get("error")
    # a second run reuses the checkpoint; the MoE benchmark's FP8 paths need CUDA: recorded as skipped
    assert ft.main([*argv[:6], "--parts", "write,moe", *argv[8:]]) == 0
    data = json.loads(out.read_text())
    assert data["checkpoint"]["reused"] and all(r.get("skipped") for r in data["moe"]["records"])
    assert [r["mode"] for r in data["results"]] == ["c", "d"] and data["logits"]["tokens"] == 64  # kept


def test_bf16_experts_equal_a_bf16_load(tmp_path, tiny):
    ckpt = tmp_path / "ckpt"
    ft.write_checkpoint(str(tiny), str(ckpt), "cpu")
    held = load_pretrained(str(ckpt), dtype=torch.bfloat16, base_precision="fp8")
    ft.dequantize_experts(held)
    plain = load_pretrained(str(ckpt), dtype=torch.bfloat16, base_precision="bf16")
    ours, ref = held.state_dict(), plain.state_dict()
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name


def _records() -> dict:
    step = {"what": "frozen FP8 experts, FP8 compute, LoRA", "tokens": 16384, "ms": 800.0, "tokens_per_s": 20480.0,
            "mfu": 0.31, "peak_gib": 40.0, "planned_gib": 42.0, "planned_over_peak": 1.05,
            "weights_gib": {"by_dtype": {"float8_e4m3fn": 24.0, "bfloat16": 1.5, "float32": 0.01}, "total": 25.51,
                            "experts": 24.1, "trained_params": 1}}
    moe = {"records": [{"provider": p, "ms": m, "tflops": t} for p, m, t in (("fp8", 6.0, 900.0),
                                                                              ("w8a16", 12.0, 450.0),
                                                                              ("bf16", 9.0, 600.0))],
           "speedup_over_bf16": {"fp8": 1.5, "w8a16": 0.75}, "target_fp8_speedup": 1.3,
           "expert_bytes_fp8_over_bf16": 0.5001, "target_bytes": 0.52}
    return {"meta": {**META, "config": "benchmarks/configs/v4_flash_slice.json", "lora_rank": 16,
                     "lora_targets": list(ft.LORA_TARGETS)},
            "results": [{**step, "mode": "a"}, {"mode": "d", "what": "everything trained, bf16", "tokens": 16384,
                                                "planned_gib": 199.6, "error": "does not fit (out of memory)"}],
            "logits": {"tokens": 4096, "rel_l2": 0.0123, "max_abs_over_max": 0.05},
            "moe": moe, "expert_bytes": {"fp8_gib": 24.1, "bf16_gib": 48.0, "ratio": 0.502, "target": 0.52},
            "ranks": {"mode": "a", "ranks": 2, "mesh": "dp_shard 2 x ep 2 (gloo, one GPU)", "tokens_per_rank": 16384,
                      "planned_gib": 30.0, "peak_gib_per_rank": [31.0, 29.0], "rc": 0}}


def test_page_section(tmp_path):
    from benchmarks.results import render_page

    d = tmp_path / "json"
    d.mkdir()

    def render() -> str:
        return render_page(d, tmp_path / "B.md", tmp_path / "plots", tmp_path / "report")

    without = render()
    assert "Fine-tuning" not in without and "finetune" not in without
    (d / "finetune.json").write_text(json.dumps(_records()))
    md = render()
    assert "\n## Fine-tuning\n" in md and "deterministic soak sharded finetune" in md
    for row in ("| (a) frozen FP8 experts, FP8 compute, LoRA | 16k | 800.0 | 20,480 | 31.0% | 40.00 | 42.00 | 1.05x | "
                "25.5 (24.0 fp8 + 1.5 bf16) |",
                "| (d) everything trained, bf16 | 16k | does not fit (out of memory) |",
                "| fp8 | 6.000 | 900.0 | 1.50x |", "| bf16 | 9.000 | 600.0 | 1.00x |",
                "relative L2 difference 1.23e-02", "bf16: 0.502 (target <= 0.52)",
                "| 0 | 31.00 | 30.00 | 0.97x |", "| 1 | 29.00 | 30.00 | 1.03x |",
                "python -m benchmarks.finetune --ckpt /tmp/csattn_v4_flash_slice --json finetune.json"):
        assert row in md, row
    # the headline comparison gains the MoE row: 1.5x faster, bf16 / FP8 bytes
    assert "| bf16 grouped: 9.000 ms | 1.50x | 1.99x |" in md


def test_moe_of_another_card_goes_beside_the_pages(tmp_path):
    """A MoE part measured on another card than the page's is merged beside the page's record (by the card's name),
    never over it, and the page shows both, each with its commit; the page's own card replaces its record."""
    from benchmarks.results import render_page
    from lab.merge_finetune import merge

    page = _records()
    other = {"meta": {**META, "device": "NVIDIA H100 80GB HBM3", "commit": "def5678", "date": "2026-12-06"},
             "moe": {**page["moe"], "records": [{**r, "ms": r["ms"] * 0.9} for r in page["moe"]["records"]],
                     "speedup_over_bf16": {"fp8": 1.4, "w8a16": 0.7}}}
    said = merge(page, other)
    assert page["moe"]["speedup_over_bf16"]["fp8"] == 1.5 and "H100" in said[0]
    card = page["moe_cards"]["NVIDIA H100 80GB HBM3"]
    assert card["commit"] == "def5678" and card["records"][0]["ms"] == pytest.approx(5.4)
    d = tmp_path / "json"
    d.mkdir()
    (d / "finetune.json").write_text(json.dumps(page))
    md = render_page(d, tmp_path / "B.md", tmp_path / "plots", tmp_path / "report")
    assert "| fp8 | 6.000 | 900.0 | 1.50x |" in md and "| fp8 | 5.400 | 900.0 | 1.40x |" in md
    assert "The same on one NVIDIA H100 80GB HBM3 (commit `def5678`, 2026-12-06;" in md
    same = {"meta": {**META, "commit": "0aa0aa0"}, "moe": other["moe"]}
    merge(page, same)
    assert page["moe"]["commit"] == "0aa0aa0" and page["moe"]["speedup_over_bf16"]["fp8"] == 1.4


def test_rank_wrapper_records_its_peak(tmp_path):
    """The ranks part's per-process wrapper: ``csattn train`` in this process, then this rank's peak file."""
    rc = ft.main(["--rank-peaks", str(tmp_path), "--", "--device", "cpu", "--steps", "1", "--seq-len", "32",
                  "--doc-min-len", "8", "--doc-max-len", "32", "--no-progress", "--export-hf", "never"])
    rec = json.loads((tmp_path / "rank0.json").read_text())
    assert rc == 0 and rec == {"peak_gib": None, "rc": 0}


def test_two_rank_run_is_mode_a_beside_the_planner(tmp_path):
    """The ranks part runs mode (a) through csattn train, its planned per-rank peak beside it."""
    import argparse

    from csattn.parallel.plan import load_config

    args = argparse.Namespace(rank_tokens=16384, lora_rank=16, ckpt=str(tmp_path), rank_steps=1, rank_timeout=5)
    rec = ft.run_ranks(load_config(ft.SLICE), args)
    assert rec["planned_gib"] > 0 and rec["ranks"] == 2
    assert rec["mode"] == "a" and "--base-precision fp8" in rec["command"]
    assert rec["rc"] != 0  # no checkpoint in tmp_path, no GPU here


def test_slice_is_v4_flash_first_layers_and_what_fits():
    """The slice keeps every V4-Flash field but the layer count (its first four layers: W, W, CSA, HCA; three
    hash-routed), MTP and the vocabulary; the planner fits modes (a)-(c) at 64k on one H200, not (d)."""
    from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig
    from csattn.parallel.plan import load_config

    with open(ft.SLICE) as f:
        part = json.load(f)
    with open(ft.SLICE.replace("v4_flash_slice", "v4_flash")) as f:
        full = json.load(f)
    lists = ("layer_types", "mlp_layer_types", "compress_ratios")
    for key, value in full.items():
        if key in lists:
            assert part[key] == value[:4], key
        elif key not in ("num_hidden_layers", "num_nextn_predict_layers", "vocab_size"):
            assert part[key] == value, key
    assert part["num_hidden_layers"] == 4 and part["mlp_layer_types"] == ["hash_moe"] * 3 + ["moe"]
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4ModelConfig.from_hf(part))
    assert model.model.layers[3].mlp.experts.gate_up_proj.shape == (256, 4096, 4096)
    c = load_config(ft.SLICE)
    fits = {m: ft.planned_gib(c, ft.MODES[m], 65536, 16)["planned_fits"] for m in ft.MODES}
    assert fits == {"a": True, "b": True, "c": True, "d": False}


def test_cases_and_the_device_copy(tmp_path, tiny):
    """``--cases`` lists lengths per mode; ``copy_to`` copies the FP8-held base tensor by tensor, bytes unchanged
    (codes stay e4m3), the base untouched."""
    assert ft._cases("a:16384,65536;d:16384") == [("a", [16384, 65536]), ("d", [16384])]
    ckpt = tmp_path / "ckpt"
    rec = ft.write_checkpoint(str(tiny), str(ckpt), "cpu", draw="device")
    assert rec["draw"] == "device" and not rec["reused"] and rec["write_s"] >= 0
    base, _ = ft.load_base(str(ckpt), "cpu")
    copy = ft.copy_to(base, torch.device("cpu"))
    want, got = base.state_dict(), copy.state_dict()
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].data_ptr() != v.data_ptr(), k
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def test_planner_counts_lora_as_the_model_runs_it():
    """The planner's LoRA counts by group (``flop_counts``: ``in + out`` of the maps run factored, multiply-adds of
    LoRA's pairs, all run factored) are the model's own, LoRA on every group it adapts."""
    from csattn.finetune.groups import LORA_GROUPS
    from csattn.finetune.lora import LoraSpec, add_lora
    from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM
    from csattn.parallel.plan import flop_counts, training_spec
    from csattn.train.config import tiny_model_config

    config = tiny_model_config()
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    add_lora(model, LoraSpec(4, 8.0, 0.0, tuple(LORA_GROUPS)))
    got = ft.lora_counts(model)
    want = flop_counts(config, training_spec(lora_rank=4, lora_targets=",".join(LORA_GROUPS)))
    assert want["lora_io"] == got["io"] > 0
