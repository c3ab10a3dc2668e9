"""``index_topk`` is capped by the entries that exist: memory and time do not grow with ``index_topk`` itself.

Before the cap, ``index_topk = 100000`` on a 60-row pack (at most 7 visible entries a row) built
``[T, 100000 + W]`` index lists and gathered keys (3 GB, 15 s); T = 2000 ran out of memory. The top-k width is
now ``min(index_topk, widest visible range)`` (HF: ``min(index_topk, compressed_len)``), the capture-safe path's
static bound there, so the results equal a run with exactly that cap.
"""

from __future__ import annotations

import pytest
import torch

from tests.cp_pool import shared_pool
from tests.cp_reliability_tasks import topk_run

pytestmark = pytest.mark.timeout(300)


def _same(a: dict, b: dict) -> None:
    for key in ("out", "dx", "loss"):
        assert torch.equal(a[key], b[key]), key
    assert a["grads"].keys() == b["grads"].keys()
    for name in a["grads"]:
        assert torch.equal(a["grads"][name], b["grads"][name]), name


@pytest.mark.parametrize("static", [False, True], ids=["default", "capture_safe"])
def test_huge_index_topk_costs_what_the_exact_cap_costs(static):
    exact = topk_run(None, 7, static)  # 60 rows, two documents of 30: at most 7 entries visible a row
    assert exact["max_visible"] == 7
    huge = topk_run(None, 100000, static)
    assert huge["largest"] == exact["largest"] < 60 * 1000  # was 25.6 M elements
    _same(huge, exact)


def test_index_topk_above_the_cap_is_the_cap():
    # between the cap and huge: same ids, same everything (the -1 columns were never a result)
    _same(topk_run(None, 9), topk_run(None, 7))


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True], ids=["default", "capture_safe"])
def test_cp_huge_index_topk_is_capped_by_the_global_count(static):
    pool = shared_pool()
    exact = pool.run_ok(topk_run, 2, topk=7, static=static)
    huge = pool.run_ok(topk_run, 2, topk=100000, static=static)
    for h, e in zip(huge, exact):
        assert h["largest"] == e["largest"] < 60 * 1000
        _same(h, e)
