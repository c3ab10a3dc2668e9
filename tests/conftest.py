import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1") if not torch.cuda.is_available() else None


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / max(||b||, tiny)`` in fp64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture
def assert_close():
    def check(actual, expected, tol, what=""):
        err = rel_err(actual, expected)
        assert torch.isfinite(actual).all(), f"{what}: non-finite values"
        assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
    return check


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
