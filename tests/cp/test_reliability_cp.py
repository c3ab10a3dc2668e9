"""Context parallelism never hangs on ranks whose metadata caches differ.

The collective input check used to be skipped on a ``PackedSeqs`` that had passed it before, so a rank reusing
its object skipped the all-reduce that a rank with a fresh (equal) object entered: that rank waited until the
process-group timeout. These ranks run with a 20 s collective timeout, so a regression fails fast instead of
hanging the suite.
"""

from __future__ import annotations

import pytest

from tests.cp_pool import RankPool
from tests.cp_reliability_tasks import LENGTHS, OTHER, cache_mismatch, fresh_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # ranks on the CPU


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(world=2, timeout=120.0, pg_timeout_s=20.0)
    yield pool
    pool.close()


@pytest.mark.parametrize("static", [False, True], ids=["default", "capture_safe"])
@pytest.mark.parametrize("case", ["reused", "second_layer"])
def test_reused_and_fresh_objects_run_the_same_collectives(pool, case, static):
    got = pool.run_ok(cache_mismatch, 2, case=case, static=static)
    expected = pool.run_ok(fresh_run, 2, lengths=LENGTHS, static=static)
    for rank_got, rank_expected in zip(got, expected):
        half = len(rank_got) // 2
        assert rank_got[:half] == rank_expected  # step 1 (all objects fresh)
        assert rank_got[half:] == rank_expected  # step 2 (cached on some ranks, fresh on others)


@pytest.mark.parametrize("static", [False, True], ids=["default", "capture_safe"])
def test_differing_metadata_raises_on_every_rank(pool, static):
    results = pool.run(cache_mismatch, 2, case="differs", static=static)
    assert all(status == "error" for status, _ in results), results
    kinds = {value[0] for _, value in results}
    messages = {value[1] for _, value in results}
    assert kinds == {"ValueError"}, results
    assert len(messages) == 1, messages
    assert "differs across the ranks" in messages.pop()
    # the group still works (nobody left inside a collective)
    pool.run_ok(fresh_run, 2, lengths=LENGTHS, static=static)


def test_in_place_edit_is_seen(pool):
    got = pool.run_ok(cache_mismatch, 2, case="edited")
    expected = pool.run_ok(fresh_run, 2, lengths=OTHER)
    for rank_got, rank_expected in zip(got, expected):
        assert rank_got[len(rank_got) // 2:] == rank_expected
