"""Per-rank activation memory under context parallelism: a rank keeps no copy of its own input.

At CP = 1 the input projections save the caller's tensor; a CP rank needs its rows plus a left halo, and
saving a concatenated ``[T / P + halo, D]`` copy would add ``T / P * D`` elements per rank that CP = 1 does
not have (0.25 GiB at 128k tokens / CP 4 in bf16). The halo rows and the rank's rows are projected piece by
piece (``RowPieces``), so every saved ``D``-wide tensor is a view of the input or at most a halo.
"""

import pytest

from tests import cp_tasks
from tests.cp_pool import shared_pool

pytestmark = pytest.mark.slow  # ranks on the CPU


@pytest.fixture(scope="module")
def pool():
    return shared_pool()


@pytest.mark.parametrize("size,partition", [(2, "contiguous"), (4, "balanced")])
def test_cp_rank_saves_no_copy_of_its_input(pool, size, partition):
    for copies in pool.run_ok(cp_tasks.saved_input_copies, size, num_rows=256, partition=partition):
        assert copies == [], copies
