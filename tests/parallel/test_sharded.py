"""Sharded training (FSDP2 + expert parallelism + context parallelism on one DeviceMesh) equals one process:
4 gloo ranks, fp64, the tiny model with every part (W / CSA / HCA layers, hash and learned MoE, shared expert,
MTP), packs whose documents cross rank boundaries; 3 AdamW steps of 4 packed sequences each."""

from __future__ import annotations

import pytest
import torch

from tests.cp_pool import shared_pool
from tests.parallel.tasks import moe_ep_task, reference, train_task

pytestmark = pytest.mark.slow

MESHES = {
    "dp_shard2-cp2": dict(dp_shard=2, cp=2),
    "dp_shard2-cp2-balanced": dict(dp_shard=2, cp=2, cp_partition="balanced"),
    "dp_shard4-ep2": dict(dp_shard=4, ep=2),  # ep takes its 2 ranks from dp_shard: efsdp = 2
    "ep2-cp2": dict(dp_shard=2, cp=2, ep=2),
    "ep2-cp2-balanced": dict(dp_shard=2, cp=2, ep=2, cp_partition="balanced"),
    "dp_replicate2-dp_shard2": dict(dp_replicate=2, dp_shard=2),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.fixture(scope="module")
def single():
    return reference()


@pytest.mark.parametrize("mesh", list(MESHES), ids=list(MESHES))
def test_mesh_equals_single_process(mesh, single):
    """The loss of every step, every gradient of the last step and every weight after 3 steps: 1e-10 relative."""
    got = shared_pool(4).run_ok(train_task, 4, **MESHES[mesh])[0]
    for a, b in zip(got["losses"], single["losses"], strict=True):
        assert abs(a - b) <= 1e-10 * abs(b)
    for a, b in zip(got["indexer"], single["indexer"], strict=True):  # logged as fp32 sums of the layers' KL
        assert abs(a - b) <= 1e-6 * abs(b)
    assert set(got["grads"]) == set(single["grads"]) and len(single["grads"]) > 100
    for k, v in single["grads"].items():
        assert _rel(got["grads"][k], v) <= 1e-10, k
    for k, v in single["state"].items():
        if v.is_floating_point():
            assert _rel(got["state"][k], v) <= 1e-10, k
        else:
            assert torch.equal(got["state"][k], v), k


@pytest.mark.parametrize("hashed_to", [None, [0, 1]], ids=["learned", "ranks-without-tokens"])
def test_expert_parallel_moe_equals_one_layer(hashed_to):
    """8 experts over 4 ranks, each with its own rows: outputs, input and every parameter gradient equal the
    whole layer's. Hash-routed to experts 0 and 1 only, ranks 1-3 receive no rows and still return (zero) gradients
    for their experts."""
    out = shared_pool(4).run_ok(moe_ep_task, 4, ep=4, hashed_to=hashed_to)
    for rank, res in enumerate(out):
        for name, err in res["errs"].items():
            assert err <= 1e-12, (rank, name, err)
    if hashed_to is not None:
        assert out[0]["received"] > 0 and all(r["received"] == 0 for r in out[1:])


def test_ranks_without_a_whole_compressor_window():
    """32-token sequences of short documents: some ranks hold no whole HCA window (16 tokens), so their compressors pool
    nothing. Their parameters must still reduce (as zeros) on every rank, or the meshes' reduce-scatters differ
    and the run crashes or hangs; the result equals one process."""
    short = dict(seq_len=32, doc_min_len=2, doc_max_len=20)
    got = shared_pool(4).run_ok(train_task, 4, dp_shard=4, **short)[0]
    single = reference(**short)
    for a, b in zip(got["losses"], single["losses"], strict=True):
        assert abs(a - b) <= 1e-10 * abs(b)
    assert set(got["grads"]) == set(single["grads"])
    for k, v in single["grads"].items():
        assert _rel(got["grads"][k], v) <= 1e-10, k
