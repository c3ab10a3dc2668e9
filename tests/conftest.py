import os

# One intra-op thread a process where the suite runs in parallel workers (`make test`: `-n 2` on two cores): many
# tests start ranks or training runs beside them, and more threads only contend (measured: the slowest tests took
# 1.8x as long with torch's default). Children inherit the variable; set it to run the suite otherwise. A run in
# one process (the GPU suite) keeps torch's default.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if "OMP_NUM_THREADS" in os.environ:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
os.environ.setdefault("TRITON_INTERPRET", "1") if not torch.cuda.is_available() else None


from .helpers import rel_err  # noqa: E402 (after TRITON_INTERPRET is set: helpers imports csattn)


@pytest.fixture
def assert_close():
    def check(actual, expected, tol, what=""):
        err = rel_err(actual, expected)
        assert torch.isfinite(actual).all(), f"{what}: non-finite values"
        assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
    return check


def _pytest_timeout(item) -> float | None:
    """The test's pytest-timeout: its ``timeout`` marker, else ``--timeout`` / the ini value (None: none)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
        if value is not None:
            return float(value)
    # pytest-timeout's value from --timeout, the ini file or PYTEST_TIMEOUT
    value = getattr(item.config, "_env_timeout", None) or getattr(item.config.option, "timeout", None)
    return float(value) if value else None


def pytest_runtest_setup(item):
    from tests import cp_pool

    cp_pool.set_test_deadline(_pytest_timeout(item))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
