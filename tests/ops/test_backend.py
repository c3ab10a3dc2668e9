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


def test_triton_off_cuda_is_a_clear_error_unless_interpreting(monkeypatch):
    """``backend="triton"`` (``csattn train --backend triton``) on a CPU used to reach Triton's launch
    and fail there with "0 active drivers"; it is refused where the backend is resolved, saying what to use, and
    the model on a CPU fails with that message at its first forward. Triton's CPU interpreter still takes it."""
    from csattn import PackedSeqs
    from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM
    from csattn.train.config import tiny_model_config

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"backend 'triton' .* need CUDA tensors; these are on cpu: use 'auto'"):
        resolve_backend("triton", torch.zeros(1))
    assert resolve_backend("auto", torch.zeros(1)) == "reference"
    model = DeepseekV4ForCausalLM(tiny_model_config(64, backend="triton", num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match="--backend auto"):
        model(torch.randint(0, 64, (24,)), packed=PackedSeqs.from_lengths([24]))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", torch.zeros(1)) == "triton"


def test_one_spelling_of_the_backend():
    """Every function of the package that picks kernels takes ``backend`` (``BackendChoice`` / ``Backend``): no
    ``use_triton`` / ``fused`` flag, no ``impl`` or ``attention_backend`` argument beside it."""
    import ast

    root = Path(csattn.__file__).parent
    other = {"use_triton", "fused", "impl", "kernel_backend", "attention_backend"}
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                found += [f"{path.relative_to(root)}:{node.lineno} {node.name}({a.arg})"
                          for a in args if a.arg in other]
    assert not found, found


def test_model_config_backend_and_its_older_name():
    """``DeepseekV4ModelConfig.backend`` (once ``attention_backend``): a saved setting under the older name still
    loads, the older keyword is refused naming the new one, a bad value names the choices."""
    from csattn.models.deepseek_v4 import DeepseekV4ModelConfig
    from tests.models.model_utils import tiny_config_dict

    raw = tiny_config_dict("flash", mtp=1)
    assert DeepseekV4ModelConfig.from_hf(raw).backend == "auto"
    assert DeepseekV4ModelConfig.from_hf({**raw, "attention_backend": "reference"}).backend == "reference"
    assert DeepseekV4ModelConfig.from_hf(raw, backend="triton").training_dict()["backend"] == "triton"
    with pytest.raises(ValueError, match=r"attention_backend= is now backend="):
        DeepseekV4ModelConfig.from_hf(raw, attention_backend="reference")
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'reference', 'triton', got 'cuda'"):
        DeepseekV4ModelConfig.from_hf(raw, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'reference', 'triton', got 'cuda'"):
        csattn.AttentionConfig(backend="cuda")
