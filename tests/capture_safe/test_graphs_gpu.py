"""CUDA graph capture of one attention layer's training step (GPU only).

One graph, captured on one pack, is replayed on three packs with different padded document boundaries
(same T, number of documents and max_seqlen): output, input gradient and every parameter gradient equal
the eager capture-safe run bitwise on the reference backend (deterministic algorithms), and match the
default eager path within fp32 / bf16 rounding. Context parallelism under capture:
tests/capture_safe/test_graphs_cp_gpu.py (NCCL, two GPUs or more).
"""

from __future__ import annotations

import os

import pytest
import torch

from csattn import PackedSeqs
from csattn.capture_safe import CapturedLayerStep, CaptureSafePackedSeqs
from tests.helpers import grads, random_layer, rel_err, tiny_config

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
pytestmark = pytest.mark.gpu

MAX_SEQLEN = 128
PACKS = [  # T = 256, 3 documents, longest physical document 128
    ([100, 50, 60], [128, 64, 64]),
    ([128, 3, 90], [128, 32, 96]),
    ([0, 120, 61], [64, 128, 64]),
]


def _pack(real, padded):
    return PackedSeqs.from_lengths(real, padded, device="cuda")


def _eager(layer, x, dy, packed):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = layer(x, packed=packed)
    y.backward(dy)
    return {"y": y.detach(), "x": x.grad, **{n: g for n, g in grads(layer).items() if g is not None}}


def _replayed(step):
    return {"y": step.y.clone(), "x": step.x_grad.clone(), **{n: g.clone() for n, g in step.grads.items()}}


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("backend,dtype", [("reference", torch.float32), ("triton", torch.bfloat16)],
                         ids=["reference_fp32", "triton_bf16"])
@pytest.mark.parametrize("layer_type", ["sliding", "csa", "hca"], ids=["W", "CSA", "HCA"])
def test_graph_replay_equals_eager_on_three_packs(layer_type, backend, dtype, deterministic):
    cfg = tiny_config(layer_type, backend=backend, hidden_size=64, num_heads=4, head_dim=64, rope_head_dim=16,
                      q_lora_rank=32, index_head_dim=32, sliding_window=16, index_topk=8)
    layer = random_layer(cfg, dtype=torch.float32).to("cuda", dtype)
    t = sum(PACKS[0][1])
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [(torch.randn(t, 64, device="cuda", generator=gen).to(dtype),
               torch.randn(t, 64, device="cuda", generator=gen).to(dtype)) for _ in PACKS]
    first = _pack(*PACKS[0])
    step = CapturedLayerStep(layer, *inputs[0], first.cu_seqlens, first.cu_seqlens_padded, MAX_SEQLEN)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, ((real, padded), (x, dy)) in enumerate(zip(PACKS, inputs)):
        packed = _pack(real, padded)
        step.replay(x, dy, packed.cu_seqlens, packed.cu_seqlens_padded)
        got = _replayed(step)
        static = CaptureSafePackedSeqs(packed.cu_seqlens, packed.cu_seqlens_padded, num_rows=t, max_seqlen=MAX_SEQLEN)
        eager = _eager(layer, x, dy, static)
        default = _eager(layer, x, dy, packed)
        assert got.keys() == eager.keys() == default.keys()
        for name in eager:
            assert torch.isfinite(got[name]).all(), (i, name)
            if backend == "reference":
                assert torch.equal(got[name], eager[name]), f"pack {i}: {name} replay != eager capture-safe"
            else:
                assert rel_err(got[name], eager[name]) <= tol, (i, name, rel_err(got[name], eager[name]))
            assert rel_err(got[name], default[name]) <= tol, (i, name, rel_err(got[name], default[name]))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("layer_type", ["sliding", "csa", "hca"], ids=["W", "CSA", "HCA"])
def test_capture_safe_step_has_no_cuda_sync(layer_type, backend):
    cfg = tiny_config(layer_type, backend=backend, capture_safe=True)
    layer = random_layer(cfg, dtype=torch.float32).to("cuda")
    packed = _pack(*PACKS[1])
    static = CaptureSafePackedSeqs(packed.cu_seqlens, packed.cu_seqlens_padded, num_rows=256, max_seqlen=MAX_SEQLEN)
    x = torch.randn(256, 32, device="cuda", requires_grad=True)
    layer(x, packed=static).sum().backward()  # warm-up: Triton compiles outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, packed=static).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
