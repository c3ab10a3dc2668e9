"""Capture-safe context parallelism (contiguous partition; ``csattn/capture_safe/cp_forward.py``) on gloo ranks.

Against the single-process layer (fp64 1e-10): outputs, input grads, parameter grads summed over ranks and
indexer losses of the W / CSA / HCA stack, on ragged, padded and degenerate packs; a second step under
``NoHostSync`` reads no device value on the host; bad input raises the same ValueError on every rank.
"""

import pytest

from tests import cp_tasks
from tests.cp.parity_cases import PACKS, check
from tests.cp_pool import shared_pool

pytestmark = pytest.mark.slow  # ranks on the CPU


@pytest.fixture(scope="module")
def pool():
    return shared_pool()


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name,lengths,pads", PACKS, ids=[p[0] for p in PACKS])
def test_capture_safe_cp_matches_single_process(pool, name, lengths, pads, size):
    err = pool.run_ok(cp_tasks.parity, size, lengths=lengths, pads=pads, partition="contiguous",
                      capture_safe=True)[0]
    check(err, 1e-10)


def test_capture_safe_cp_triton_backend(pool):
    pytest.importorskip("triton")
    err = pool.run_ok(cp_tasks.parity, 2, lengths=[5, 37, 1, 30], partition="contiguous", dtype="float32",
                      types=("csa", "hca"), backend="triton", capture_safe=True)[0]
    check(err, 1e-5)


def test_capture_safe_cp_rejects_balanced_partition_on_every_rank(pool):
    results = pool.run(cp_tasks.capture_safe_rejects, 2, partition="balanced")
    assert [r[0] for r in results] == ["error", "error"], results
    assert all("contiguous" in r[1][1] for r in results), results
