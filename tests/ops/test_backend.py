"""The one backend resolver (``csattn.ops.backend``): ``"auto"`` by device, the choices checked with one message,
and one reading of ``TRITON_INTERPRET`` for the whole package."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import csattn
from csattn.ops.backend import check_backend, interpreting, resolve_backend, use_triton


def test_auto_resolves_by_device():
    cpu = torch.zeros(1)
    assert resolve_backend("auto", cpu) == "reference"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("auto", "cpu", choices=("auto", "reference", "grouped", "triton"), off_cuda="grouped") \
        == "grouped"
    assert resolve_backend("triton", cpu) == "triton" and resolve_backend("reference", "cuda") == "reference"


def test_bad_backend_names_the_choices():
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'reference', 'triton', got 'cuda'"):
        resolve_backend("cuda", torch.zeros(1))
    with pytest.raises(ValueError, match="'reference', 'triton', got 'auto'"):
        use_triton("auto")  # an attention op's dispatch point takes a resolved backend
    assert check_backend("grouped", ("grouped",)) == "grouped"


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("0", False), ("", False)])
def test_interpreting_reads_the_environment_at_each_call(monkeypatch, value, expected):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() is expected


def test_one_reading_of_triton_interpret():
    """Only ``ops/backend.py`` reads ``TRITON_INTERPRET``; every other check goes through ``interpreting()``."""
    root = Path(csattn.__file__).parent
    readers = [p.relative_to(root).as_posix() for p in root.rglob("*.py") if "environ" in p.read_text()
               and "TRITON_INTERPRET" in p.read_text()]
    assert readers == ["ops/backend.py"], readers
