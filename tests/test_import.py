"""``import csattn`` stays light: the compiler stack (``torch._dynamo``, sympy, Triton) loads only when a path that
needs it runs, so ``csattn --help`` and CPU scripts do not pay ~2.5 s and ~900 modules for it."""

import subprocess
import sys

import pytest

HEAVY = ("torch._dynamo", "sympy", "triton")


@pytest.mark.parametrize("module", ["csattn", "csattn.cli", "csattn.models.deepseek_v4"])
def test_import_does_not_load_the_compiler(module):
    code = f"import sys, {module}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "", f"import {module} loaded {out.stdout.strip()}"
