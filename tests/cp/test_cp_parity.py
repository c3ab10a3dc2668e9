"""Context parallelism (gloo, spawned ranks) against the single-process layer: W / CSA / HCA stack, forward
and backward, CP = 2, 3, 4, both partitions."""

from __future__ import annotations

import pytest

from tests import cp_tasks
from tests.cp.parity_cases import PACKS, check
from tests.cp_pool import shared_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # ranks on the CPU

SIZES = [2, 3, 4]
PARTITIONS = ["contiguous", "balanced"]


@pytest.fixture(scope="module")
def pool():
    return shared_pool()


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name,lengths,pads", PACKS, ids=[p[0] for p in PACKS])
def test_cp_matches_single_process_fp64(pool, name, lengths, pads, size, partition):
    err = pool.run_ok(cp_tasks.parity, size, lengths=lengths, pads=pads, partition=partition)[0]
    check(err, 1e-10)
    if name in ("rank_without_group", "no_entry_anywhere") and partition == "contiguous":
        assert err["_min_owned"] == 0, "the pack was meant to leave a rank without a compressed group"


@pytest.mark.parametrize("partition", PARTITIONS)
def test_cp_group_of_one(pool, partition):
    err = pool.run_ok(cp_tasks.parity, 1, lengths=[5, 37, 1, 30, 19], partition=partition)[0]
    check(err, 1e-10)


@pytest.mark.parametrize("size,partition", [(2, "balanced"), (3, "contiguous"), (4, "balanced")])
def test_cp_ragged_spec_pack(pool, size, partition):
    """SPEC section 7's 12-document pack, padded to 4096 rows (and on to a multiple of the chunk count)."""
    lengths = [5, 127, 1000, 23, 129, 900, 55, 257, 800, 95, 509, 148]
    pads = [0] * 11 + [4096 - sum(lengths)]
    err = pool.run_ok(cp_tasks.parity, size, lengths=lengths, pads=pads, partition=partition,
                      attn_chunk_rows=1024, workspace_bytes=1 << 22)[0]
    check(err, 1e-10)


@pytest.mark.parametrize("size,partition", [(2, "contiguous"), (3, "balanced"), (4, "contiguous")])
def test_cp_fp32(pool, size, partition):
    err = pool.run_ok(cp_tasks.parity, size, lengths=[5, 37, 1, 64, 19, 100, 3, 40], partition=partition,
                      dtype="float32")[0]
    check(err, 1e-5)


@pytest.mark.parametrize("size,partition", [(2, "balanced"), (3, "contiguous")])
def test_cp_dense_indexer_loss(pool, size, partition):
    err = pool.run_ok(cp_tasks.parity, size, lengths=[13, 27, 50, 23], partition=partition,
                      indexer_loss_type="dense")[0]
    check(err, 1e-10)


def test_cp_memory_no_global_sized_activation(pool):
    """No floating tensor on a rank grows like T * width: the largest is bounded by the rank's ext rows plus
    the gathered compressed entries (T / r rows), or by one sparse-attention chunk over all T / r HCA entries."""
    for res in pool.run_ok(cp_tasks.memory_probe, 4, num_rows=512):
        assert res["numel"] <= res["bound"] < res["global"], res


@pytest.mark.parametrize("size,partition", [(2, "contiguous"), (2, "balanced")])
def test_cp_triton_backend(pool, size, partition):
    """The fused path under CP (Triton interpreter on the CPU, CUDA on a GPU machine): halo rows projected
    piece by piece, Triton compressor / top-k / core kernels on each rank, against the single-process run."""
    pytest.importorskip("triton")
    err = pool.run_ok(cp_tasks.parity, size, lengths=[5, 37, 1, 30], partition=partition, dtype="float32",
                      types=("csa", "hca"), backend="triton")[0]
    check(err, 1e-5)
