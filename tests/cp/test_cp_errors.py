"""Bad input under context parallelism: every rank raises the same clear ValueError and nothing hangs."""

from __future__ import annotations

import pytest

from tests import cp_tasks
from tests.cp_pool import shared_pool

pytestmark = pytest.mark.timeout(300)

CASES = [
    ("short_shard", "shorter than the 7-row left halo"),
    ("not_divisible", "do not split into"),
    ("mismatched", "differs across the ranks"),
    ("wrong_rows", "must hold this rank's"),
]


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("case,phrase", CASES, ids=[c[0] for c in CASES])
def test_cp_bad_input_same_error_everywhere(case, phrase, size):
    pool = shared_pool()
    results = pool.run(cp_tasks.bad_input, size, case=case)
    assert all(status == "error" for status, _ in results), results
    kinds = {value[0] for _, value in results}
    messages = {value[1] for _, value in results}
    assert kinds == {"ValueError"}, results
    assert len(messages) == 1, f"ranks raised different errors: {messages}"
    assert phrase in messages.pop()
    # the group is still usable afterwards (no rank stuck in a half-done collective)
    err = pool.run_ok(cp_tasks.parity, size, lengths=[20, 30, 14])[0]
    assert max(v for k, v in err.items() if not k.startswith("_")) <= 1e-10


def test_cp_needs_initialized_group():
    from csattn import ContextParallel

    with pytest.raises(ValueError, match="initialized torch.distributed"):
        ContextParallel(None)


def test_cp_rejects_unknown_partition():
    from csattn.cp.partition import num_chunks

    with pytest.raises(ValueError, match="partition must be one of"):
        num_chunks("zigzag", 2)
