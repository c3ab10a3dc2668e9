"""Fuzz: a NaN / Inf planted in random rows (real or padding) changes nothing outside its document.

Random packs with empty, one-row and padded documents, random W / CSA / HCA stacks, CP sizes 1-4 (1 = the
single-process layer) and both partitions: every row outside a poisoned document (and every padding row
other than the poisoned one) keeps a finite output and input gradient, bit for bit equal to the clean run.
Planted in padding rows only, it reaches no parameter gradient either: each rank's are finite and bit for bit
the clean run's (padding is not data). The CP ranks come from the shared gloo pool, so no example spawns
processes.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cp_pool import shared_pool
from tests.cp_tasks import TYPES
from tests.isolation_tasks import cp_isolation

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # ranks on the CPU

VALUES = [float("nan"), float("inf"), -float("inf")]


@st.composite
def cases(draw):
    n = draw(st.integers(1, 5))
    # 0 = an empty document, 1 = a one-row document; longer ones span several compression blocks
    lengths = draw(st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(2, 30)), min_size=n, max_size=n))
    pads = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    types = draw(st.lists(st.sampled_from(TYPES), min_size=1, max_size=3))
    size = draw(st.integers(1, 4))
    partition = draw(st.sampled_from(["contiguous", "balanced"]))
    bad = draw(st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(VALUES)), min_size=1, max_size=2))
    return lengths, pads, types, size, partition, bad


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cases())
def test_planted_nan_or_inf_stays_in_its_document(case):
    lengths, pads, types, size, partition, bad = case
    problems = shared_pool().run_ok(cp_isolation, size, lengths=lengths, pads=pads, partition=partition,
                                    types=types, bad=bad)
    assert all(p == [] for p in problems), (case, problems)


@st.composite
def padding_cases(draw):
    lengths, pads, types, size, partition, bad = draw(cases())
    i = draw(st.integers(0, len(pads) - 1))
    pads[i] = max(pads[i], 1)  # at least one padding row to poison
    return lengths, pads, types, size, partition, bad


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(padding_cases())
def test_planted_nan_or_inf_in_padding_reaches_no_parameter_gradient(case):
    lengths, pads, types, size, partition, bad = case
    problems = shared_pool().run_ok(cp_isolation, size, lengths=lengths, pads=pads, partition=partition,
                                    types=types, bad=bad, pad_only=True)
    assert all(p == [] for p in problems), (case, problems)
