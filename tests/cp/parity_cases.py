"""The packs and the check shared by the CP parity tests (eager and capture-safe)."""

from __future__ import annotations

# (id, real lengths, padding rows per document); the last document is padded further to a multiple of the
# chunk count. Tiny geometry: window 8, CSA ratio 4, HCA ratio 8, halo 7.
PACKS = [
    ("cut_in_doc", [96], None),
    ("cut_in_block", [1, 119], None),  # document starts at row 1: every rank cut falls inside a block
    ("cut_on_block_edge", [64, 64], None),  # cuts at multiples of 8 (block edges of both ratios)
    ("short_docs", [3, 2, 7, 1, 5, 40, 3, 6, 2, 30, 1], None),  # shorter than r and than W
    ("non_multiple", [13, 27, 50, 23], None),
    ("padding", [10, 30, 20, 33], [2, 3, 0, 5]),
    ("rank_without_group", [100] + [3, 2, 1] * 17, None),  # later ranks hold only documents shorter than r
    ("no_entry_anywhere", [3, 2, 3, 1] * 8, None),  # no compressed entry in the stream: no entry gather
]


def check(err: dict, tol: float) -> None:
    bad = {k: v for k, v in err.items() if not k.startswith("_") and not v <= tol}
    assert not bad, f"CP differs from the single-process run beyond {tol:g}: {bad}"
    assert any("compressor.indexer." in k for k in err), "indexer grads were not compared"
    assert any(k.startswith("loss") for k in err), "the indexer loss was not compared"
