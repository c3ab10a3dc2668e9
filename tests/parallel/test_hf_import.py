"""Per-rank HF import of a release-format checkpoint (FP8 dense weights, MXFP4 experts) under expert
parallelism equals the single-process load bit for bit, each rank reading only its own experts, and the
sharded HF export reads back to the same weights."""

from __future__ import annotations

import pytest
import torch

from csattn.models.deepseek_v4.checkpoint import load_pretrained
from tests.cp_pool import shared_pool
from tests.models.test_quantized_checkpoint import tiny, write_quantized
from tests.parallel.tasks import hf_import_task

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("dims", [dict(dp_shard=4, ep=2), dict(dp_shard=2, cp=2, ep=2)],
                         ids=["dp_shard4-ep2", "dp_shard2-cp2-ep2"])
def test_per_rank_import_equals_single_process_and_export_round_trips(tmp_path, dims):
    release, export = tmp_path / "release", tmp_path / "export"
    model = tiny(seed=7, mtp=1)
    write_quantized(model, release, convention="reference")
    one = load_pretrained(str(release), dtype=torch.float32).state_dict()

    got = shared_pool(4).run_ok(hf_import_task, 4, path=str(release), dims=dims, export=str(export))
    state = got[0]["state"]
    assert sorted(state) == sorted(one)
    for name, ref in one.items():
        assert torch.equal(state[name].to(ref.dtype), ref), name

    # the experts split over ep: each ep rank reads its own half, the two halves cover every expert once
    n_experts = model.config.n_routed_experts
    held = [tuple(r["experts"]) for r in got]
    assert sorted(set(held)) == [tuple(range(0, n_experts // 2)), tuple(range(n_experts // 2, n_experts))]

    back = load_pretrained(str(export), dtype=torch.float32).state_dict()
    assert sorted(back) == sorted(one)
    for name, ref in one.items():
        assert torch.equal(back[name], ref), name
