"""A NaN / Inf in one row changes nothing outside its document (single process, reference and Triton).

Before the masked gathers, an empty index slot read row 0 (another document's row): a poisoned query's
``0 * NaN`` key gradient landed on row 0, and a poisoned row 0 made every row with an empty slot NaN.
"""

from __future__ import annotations

import pytest
import torch

from csattn import PackedSeqs
from csattn.ops.indices import gather_rows_masked
from tests.cp_tasks import build_stack
from tests.isolation_tasks import isolation_errors

pytestmark = pytest.mark.timeout(300)

# docs: 20 real + 4 pad | 17 + 3 | empty | 1 + 2 | 9 + 3  (rows 0-23, 24-43, -, 44-46, 47-58)
LENGTHS, PADDED = [20, 17, 0, 1, 9], [24, 20, 0, 3, 12]
ROWS = {"row 0": 0, "real mid": 30, "pad of doc 0": 21, "pad of doc 1": 43, "one-row doc": 44,
        "pad of one-row doc": 46, "last pad": 58}


def _pack() -> PackedSeqs:
    return PackedSeqs.from_lengths(LENGTHS, padded_lengths=PADDED)


@pytest.mark.slow  # a layer or model through the Triton interpreter
@pytest.mark.parametrize("types,value", [
    (("sliding",), float("nan")), (("csa",), float("nan")), (("hca",), float("nan")),
    (("sliding", "csa", "hca"), float("inf")), (("sliding", "csa", "hca"), -float("inf")),
])
def test_poisoned_row_stays_in_its_document_reference(types, value):
    layers = build_stack(torch.float64, 0, types)
    gen = torch.Generator().manual_seed(1)
    T = _pack().num_rows
    x = torch.randn(T, 32, generator=gen, dtype=torch.float64)
    g = torch.randn(T, 32, generator=gen, dtype=torch.float64)
    for name, row in ROWS.items():
        assert isolation_errors(layers, _pack, x, g, [(row, value)]) == [], name
    # two poisoned rows in two documents at once
    assert isolation_errors(layers, _pack, x, g, [(0, value), (46, value)]) == []


@pytest.mark.slow  # a layer or model through the Triton interpreter
@pytest.mark.parametrize("types", [("sliding",), ("csa",), ("hca",)])
def test_poisoned_row_stays_in_its_document_triton(types):
    layers = build_stack(torch.float32, 0, types, backend="triton")

    def pack() -> PackedSeqs:
        return PackedSeqs.from_lengths([13, 0, 1, 9], padded_lengths=[16, 0, 3, 10])

    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(29, 32, generator=gen), torch.randn(29, 32, generator=gen)
    for row in (0, 14):  # row 0 (every other row's empty slots used to read it), a padding row
        assert isolation_errors(layers, pack, x, g, [(row, float("nan"))]) == [], row


def test_gather_rows_masked_sends_no_gradient_to_row_zero():
    table = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[1, -1], [-1, 2]])
    rows = gather_rows_masked(table, ids)
    assert (rows[0, 1] == 0).all() and (rows[1, 0] == 0).all()
    assert torch.equal(rows[0, 0], table[1]) and torch.equal(rows[1, 1], table[2])
    (rows * torch.full_like(rows, float("nan"))).sum().backward()
    assert torch.equal(table.grad[0], torch.zeros(3, dtype=torch.float64))  # no 0 * NaN from the -1 slots
    assert torch.isnan(table.grad[1:3]).all()
