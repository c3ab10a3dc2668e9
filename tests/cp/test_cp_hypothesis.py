"""Property test: random packs, CP sizes and partitions all match the single-process layer stack."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import cp_tasks
from tests.cp_pool import shared_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # ranks on the CPU


@st.composite
def packs(draw):
    n = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    pads = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    size = draw(st.sampled_from([2, 3, 4]))
    partition = draw(st.sampled_from(["contiguous", "balanced"]))
    return lengths, pads, size, partition


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(packs())
def test_cp_random_packs_match_single_process(pack):
    lengths, pads, size, partition = pack
    err = shared_pool().run_ok(cp_tasks.parity, size, lengths=lengths, pads=pads, partition=partition)[0]
    bad = {k: v for k, v in err.items() if not k.startswith("_") and not v <= 1e-10}
    assert not bad, (pack, bad)
