"""The planner (``csattn plan``): parameter counts, per-rank sharding, errors naming the flag, the CLI (CPU, fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from csattn.models.deepseek_v4 import DeepseekV4ModelConfig
from csattn.parallel.mesh import ParallelDims
from csattn.parallel.plan import count_params, plan, search

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def _load(name: str, **overrides) -> DeepseekV4ModelConfig:
    return DeepseekV4ModelConfig.from_hf(json.loads((CONFIGS / name).read_text()), **overrides)


def test_v4_flash_parameter_count():
    c = _load("v4_flash.json")
    decoder = count_params(_load("v4_flash.json", num_nextn_predict_layers=0)).total
    assert abs(decoder / 284e9 - 1) < 0.02, decoder  # the published 284 B counts the decoder
    assert count_params(c).total > decoder  # plus the MTP block
    assert abs(count_params(_load("v4_pro.json")).total / 1.6e12 - 1) < 0.02


def test_count_matches_the_model_on_meta():
    torch = pytest.importorskip("torch")
    from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM

    c = _load("v4_flash_proxy.json", num_nextn_predict_layers=1)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(c)
    assert count_params(c).total == sum(p.numel() for p in model.parameters())


def test_per_rank_parameters_scale_with_the_shards():
    c = _load("v4_flash.json")
    pc = count_params(c)
    for gpus, ep in ((64, 1), (64, 8), (128, 8), (128, 32)):
        p = plan(c, ParallelDims(ep=ep, world=gpus), 4096, recompute="full")
        dims = ParallelDims(ep=ep, world=gpus).resolve()
        assert p.memory.parameters == pytest.approx(4.0 * pc.dense / dims.fsdp
                                                    + 4.0 * pc.experts / (dims.ep * dims.efsdp))
        assert p.memory.optimizer == pytest.approx(2 * p.memory.parameters)
    a = plan(c, ParallelDims(world=64), 4096).memory.parameters
    b = plan(c, ParallelDims(world=128), 4096).memory.parameters
    assert a == pytest.approx(2 * b)


def test_memory_record_prints_its_terms_in_order(capsys):
    """``Plan.memory`` is a record of named terms; the table names them in words, in the record's order, the FP8
    workspace only when frozen FP8 weights are multiplied."""
    from csattn.parallel.plan import format_plan

    p = plan(_load("v4_flash.json"), ParallelDims(ep=8, world=64), 4096, recompute="full")
    names = ["parameters", "gradients", "optimizer", "gathered units", "comm buffers", "activations kept",
             "workspaces"]
    assert [k for k, _ in p.memory.terms()] == names and p.memory.fp8_workspace == 0
    assert p.total == pytest.approx(sum(v for _, v in p.memory.terms())) and p.peak < p.total
    table = format_plan(p).splitlines()
    at = table.index("  per rank (GiB):")
    assert [line.split()[:-1] for line in table[at + 1:at + 8]] == [n.split() for n in names]
    with pytest.raises(AttributeError):
        p.memory.parameters = 0.0  # frozen: the plan's terms are set once, by plan()


def test_bad_meshes_name_the_flag():
    c = _load("v4_flash.json")
    with pytest.raises(ValueError, match="--dp-shard"):
        plan(c, ParallelDims(dp_shard=3, cp=2, world=8), 4096)
    with pytest.raises(ValueError, match="--ep"):
        plan(c, ParallelDims(dp_shard=12, ep=12, world=12), 4096)  # 12 does not divide 256 experts
    with pytest.raises(ValueError, match="--ep"):
        plan(c, ParallelDims(dp_shard=4, ep=8, world=4), 4096)


def test_cli_prints_the_fit_and_the_peak(capsys):
    from csattn.cli import main

    proxy = str(CONFIGS / "v4_flash_proxy.json")
    assert main(["plan", "--config", proxy, "--gpus", "1", "--seq-len", "16384", "--recompute", "none"]) == 0
    out = capsys.readouterr().out
    assert "fit: yes" in out and "decides the fit" in out
    assert main(["plan", "--config", str(CONFIGS / "v4_flash.json"), "--gpus", "8", "--seq-len", "4096",
                 "--ep", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and data["dims"]["ep"] == 8
    assert data["memory"]["gathered_units"] > 0 and data["total"] == pytest.approx(sum(data["memory"].values()))
    assert main(["plan", "--config", proxy, "--gpus", "8", "--dp-shard", "3", "--cp", "2"]) == 2


FLASH = str(CONFIGS / "v4_flash.json")
PROXY = str(CONFIGS / "v4_flash_proxy.json")


def _plan_cli(capsys, *argv: str) -> tuple[int, str, str]:
    from csattn.cli import main

    rc = main(["plan", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_search_honours_batch_seqs_dtype_recompute_and_fixed_sizes():
    c = _load("v4_flash_proxy.json")
    assert search(c, 8, 16384, batch_seqs=32).batch_seqs == 32
    p = search(c, 8, 16384)
    assert p.batch_seqs == p.dims["dp_replicate"] * p.dims["dp_shard"]  # one per replica by default
    assert search(c, 8, 16384, dtype="float32").dtype == "float32"
    assert search(c, 8, 16384, recompute="mhc").recompute == "mhc"
    p = search(c, 8, 16384, mesh={"cp": 2, "ep": 4})
    assert (p.dims["cp"], p.dims["ep"], p.dims["dp_shard"] * p.dims["dp_replicate"]) == (2, 4, 4)
    # --batch-seqs 7 takes only a mesh of one data replica: CP 8 (as the plain plan with --cp 8 would)
    p = search(c, 8, 65536, batch_seqs=7)
    assert p.batch_seqs == 7 and p.dims["cp"] == 8
    with pytest.raises(ValueError, match="--batch-seqs 7"):  # 4096 / 8 rows: no CP 8, so no mesh takes 7
        search(c, 8, 4096, batch_seqs=7)
    with pytest.raises(ValueError, match="--ep 3"):
        search(c, 8, 4096, mesh={"ep": 3})


def test_search_cli_refuses_what_no_mesh_takes(capsys):
    rc, out, err = _plan_cli(capsys, "--config", PROXY, "--gpus", "8", "--seq-len", "4096", "--batch-seqs", "7",
                             "--search")
    assert rc == 2 and out == "" and err.startswith("csattn plan: error: no mesh of 8 GPUs")
    assert "--batch-seqs 7" in err and len(err.strip().splitlines()) == 1
    rc, out, err = _plan_cli(capsys, "--table", "--config", PROXY)
    assert rc == 2 and "--table" in err


def test_output_one_peak_decides_in_gib_with_the_train_line(capsys):
    rc, out, _ = _plan_cli(capsys, "--config", FLASH, "--gpus", "64", "--seq-len", "65536", "--search")
    assert rc == 0
    assert "efsdp: the experts' FSDP mesh, what ep leaves of dp_shard x cp" in out
    assert "decides the fit" in out and "fit: yes: peak" in out
    assert " GB " not in out and " GB)" not in out and "benchmarks.run" not in out
    assert "total" not in [line.split()[0] for line in out.splitlines() if line.startswith("    ")]
    train = [line.strip() for line in out.splitlines() if "-m csattn train" in line]
    assert train[0].startswith("torchrun --nnodes 8 --nproc-per-node 8 ")
    assert "next best meshes" in out
    ups = [line for line in out.splitlines() if line.lstrip()[:2] in ("2.", "3.", "4.")]
    assert len(ups) == 3 and len({u.split(",")[0] for u in ups}) == 3  # distinct meshes


def test_the_train_line_parses_and_plans_the_same(capsys):
    """The printed line is accepted by ``csattn train``'s own parser and its flags give back the same plan."""
    from csattn.cli import build_parser

    for config, gpus, seq_len in ((PROXY, 8, 16384), (FLASH, 128, 4096)):
        c = DeepseekV4ModelConfig.from_hf(json.loads(Path(config).read_text()))
        rc, out, _ = _plan_cli(capsys, "--config", config, "--gpus", str(gpus), "--seq-len", str(seq_len),
                               "--search", "--dp-shard", str(gpus), "--recompute", "full")
        assert rc == 0
        line = next(x.strip() for x in out.splitlines() if "-m csattn train" in x)
        launcher, flags = line.split(" -m csattn ")
        assert (f"--nproc-per-node {gpus}" if gpus <= 8 else f"--nnodes {gpus // 8} --nproc-per-node 8") in launcher
        a = build_parser().parse_args(flags.split())
        assert a.config_json == config and a.dp_shard == gpus and a.recompute == "full"
        p = plan(c, ParallelDims(dp_replicate=a.dp_replicate, dp_shard=a.dp_shard, cp=a.cp, ep=a.ep, world=gpus),
                 a.seq_len, batch_seqs=a.batch_seqs, recompute=a.recompute, dtype=a.dtype)
        assert p.fits and f"peak: {p.peak / 2**30:.2f} GiB" in out


def test_the_fine_tune_line_parses_and_plans_the_same(capsys):
    """The LoRA fine-tune of V4-Flash on one node: the printed line reads the release checkpoint (an FP8-held base
    has no initializer), is accepted by ``csattn train``'s parser, and its flags give back the same plan."""
    from csattn.cli import build_parser
    from csattn.parallel.plan import training_spec

    c = DeepseekV4ModelConfig.from_hf(json.loads(Path(FLASH).read_text()))
    for extra in ([], ["--fp8-linears"]):
        rc, out, _ = _plan_cli(capsys, "--config", FLASH, "--gpus", "8", "--seq-len", "65536", "--lora-rank", "16",
                               "--search", *extra)
        assert rc == 0 and "fit: yes" in out
        line = next(x.strip() for x in out.splitlines() if "-m csattn train" in x)
        launcher, flags = line.split(" -m csattn ")
        assert launcher == "torchrun --nproc-per-node 8" and "--init-from CHECKPOINT_DIR" in flags
        a = build_parser().parse_args(flags.split())
        assert a.lora_rank == 16 and a.base_precision == "fp8" and a.fp8_linears == bool(extra)
        t = training_spec(lora_rank=a.lora_rank, lora_targets=a.lora_targets, train=a.train_groups,
                          freeze=a.freeze_groups, base_precision=a.base_precision, fp8_linears=a.fp8_linears)
        p = plan(c, ParallelDims(dp_replicate=a.dp_replicate, dp_shard=a.dp_shard, cp=a.cp, ep=a.ep, world=8),
                 a.seq_len, batch_seqs=a.batch_seqs, recompute=a.recompute, dtype=a.dtype, training=t)
        assert p.fits and p.dims["efsdp"] == 1 and f"peak: {p.peak / 2**30:.2f} GiB" in out
        assert ("held in FP8 (fp8): experts," in out) == (not extra)


def test_does_not_fit_says_what_would(capsys):
    rc, out, _ = _plan_cli(capsys, "--config", FLASH, "--gpus", "8", "--seq-len", "4096", "--search")
    assert rc == 1 and out.startswith("does not fit:") and "nearest that fit:" in out
    more = next(line for line in out.splitlines() if "more GPUs:" in line)
    assert int(more.split(":")[1].split()[0]) > 8
    # the plain plan that does not fit: the same mesh with more recompute
    rc, out, _ = _plan_cli(capsys, "--config", PROXY, "--gpus", "1", "--seq-len", "262144")
    assert rc == 0 and "fit: NO" in out and "more recompute: moe (this mesh)" in out
    assert "csattn train --config-json" in out.split("more recompute")[1]
    # nothing fits on these GPUs at this length: more GPUs, or shorter sequences
    rc, out, _ = _plan_cli(capsys, "--config", PROXY, "--gpus", "1", "--seq-len", "1048576", "--search")
    assert rc == 1 and "more GPUs: 2 GPU(s)" in out and "shorter sequences: 1 GPU(s)" in out


def test_every_flag_has_help_and_a_bad_config_is_one_error_line(capsys, tmp_path):
    from csattn.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["plan"]
    for action in sub._actions:
        assert action.help, action.option_strings
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    for argv in ([], ["--config", str(tmp_path / "missing.json")], ["--config", str(bad)],
                 ["--config", str(tmp_path)]):
        rc, out, err = _plan_cli(capsys, *argv)
        assert rc == 2 and out == "" and err.startswith("csattn plan: error: "), (argv, err)
        assert len(err.strip().splitlines()) == 1


def test_the_train_line_starts_from_a_checkpoint_directory(capsys, tmp_path):
    ckpt = tmp_path / "DeepSeek-V4-Flash"
    ckpt.mkdir()
    (ckpt / "config.json").write_text((CONFIGS / "v4_flash_proxy.json").read_text())
    (ckpt / "model.safetensors.index.json").write_text("{}")
    for config in (ckpt, ckpt / "config.json"):
        rc, out, _ = _plan_cli(capsys, "--config", str(config), "--gpus", "8", "--seq-len", "16384", "--search")
        assert rc == 0 and f"-m csattn train --init-from {ckpt} " in out
    (ckpt / "model.safetensors.index.json").unlink()  # a config alone: a random model of its geometry
    rc, out, _ = _plan_cli(capsys, "--config", str(ckpt), "--gpus", "8", "--seq-len", "16384", "--search")
    assert f"--config-json {ckpt / 'config.json'} " in out


def test_module_entry_point_runs_the_same_planner(capsys):
    from csattn.parallel.plan import main

    assert main(["--config", PROXY, "--gpus", "8", "--seq-len", "16384", "--search", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True
    with pytest.raises(SystemExit) as e:
        main(["--config", PROXY, "--train", "head", "--freeze", "experts"])
    assert e.value.code == 2 and "--train and --freeze" in capsys.readouterr().err
