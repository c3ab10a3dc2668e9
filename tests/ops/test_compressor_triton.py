"""Triton compressor pooling against ``compress_pool_ref`` (fp64): outputs and the gradients of ``kv``,
``gate`` and ``position_bias``, for the overlapping CSA layout (r=4) and plain blocks (HCA-like)."""

import pytest
import torch

from csattn.ops.compressor import compress_pool
from csattn.packing import PackedSeqs
from tests.helpers import poison_kernel_outputs, rel_err


@pytest.fixture(autouse=True)
def _poisoned_kernel_outputs(monkeypatch):
    """Every kernel output starts as NaN, so an element the kernel does not write fails."""
    import csattn.ops.compressor.triton

    poison_kernel_outputs(monkeypatch, csattn.ops.compressor.triton)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(lengths, padded, ratio, overlap, c, gen, dtype=torch.float64):
    packed = PackedSeqs.from_lengths(lengths, padded_lengths=padded)
    meta = packed.compress(ratio, device=torch.device(DEVICE))
    width = c * (2 if overlap else 1)
    T = packed.num_rows
    kv = torch.randn(T, width, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    gate = torch.randn(T, width, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    bias = torch.randn(ratio, width, generator=gen, dtype=torch.float64).to(DEVICE)
    return (kv, gate, bias), meta


def _run(backend, tensors, meta, ratio, overlap, grad_out, dtype):
    kv, gate, bias = tensors
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = [kv.to(dtype).clone().requires_grad_(), gate.to(dtype).clone().requires_grad_(),
              bias.to(wide).clone().requires_grad_()]
    out = compress_pool(*leaves, meta.entry_row, meta.entry_first, ratio, overlap, backend=backend)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize(
    "ratio,overlap,c",
    [pytest.param(4, True, 24, id="csa_r4_overlap"), pytest.param(8, False, 20, id="blocks_r8"),
     pytest.param(4, False, 16, id="blocks_r4")],
)
def test_pool_matches_reference(ratio, overlap, c, assert_close):
    gen = torch.Generator().manual_seed(ratio + c)
    # Documents shorter than r, trailing partial blocks, padding rows, a document of exactly one block.
    tensors, meta = _inputs([37, 70, 3, 30, 9, 8], [40, 72, 4, 32, 9, 8], ratio, overlap, c, gen)
    grad_out = torch.randn(meta.num_entries, c, generator=gen, dtype=torch.float64).to(DEVICE)
    ref, ref_grads = _run("reference", tensors, meta, ratio, overlap, grad_out, torch.float64)
    got, grads = _run("triton", tensors, meta, ratio, overlap, grad_out, torch.float32)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert_close(got, ref, 1e-6, "pooled")
    for name, g, r in zip(("kv", "gate", "position_bias"), grads, ref_grads):
        assert_close(g, r, 1e-6, f"grad {name}")


def test_pool_no_entries():
    gen = torch.Generator().manual_seed(0)
    tensors, meta = _inputs([3, 2], [3, 2], 4, True, 16, gen)
    got, grads = _run("triton", tensors, meta, 4, True, torch.zeros(0, 16, dtype=torch.float64), torch.float32)
    assert got.shape == (0, 16)
    assert all(float(g.abs().sum()) == 0.0 for g in grads)


def test_pool_bad_input():
    kv = torch.zeros(8, 6)
    rows, first = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool)
    with pytest.raises(ValueError, match="position_bias"):
        compress_pool(kv, kv, torch.zeros(3, 6), rows, first, 4, True, backend="triton")
    with pytest.raises(ValueError, match="divisible"):
        compress_pool(torch.zeros(8, 5), torch.zeros(8, 5), torch.zeros(4, 5), rows, first, 4, True,
                      backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "ratio,overlap,c", [(4, True, 512), (128, False, 512), (4, True, 128)], ids=["csa", "hca", "indexer"])
def test_pool_gpu_bf16_real_geometry(ratio, overlap, c):
    """bf16 at the model's widths on a 32k ragged pack: error vs fp64 within twice the same-dtype reference's."""
    gen = torch.Generator().manual_seed(ratio)
    lengths = [9000, 127, 5, 12000, 1000, 10636]
    tensors, meta = _inputs(lengths, [9000, 128, 8, 12000, 1000, 10640], ratio, overlap, c, gen)
    tensors = tuple(t.to(torch.bfloat16).double() if i < 2 else t for i, t in enumerate(tensors))
    grad_out = torch.randn(meta.num_entries, c, generator=gen, dtype=torch.float64).to(DEVICE)
    ref, ref_grads = _run("reference", tensors, meta, ratio, overlap, grad_out, torch.float64)
    same, same_grads = _run("reference", tensors, meta, ratio, overlap, grad_out, torch.bfloat16)
    got, grads = _run("triton", tensors, meta, ratio, overlap, grad_out, torch.bfloat16)
    assert rel_err(got, ref) <= 2 * rel_err(same, ref) + 1e-6
    for name, g, s, r in zip(("kv", "gate", "position_bias"), grads, same_grads, ref_grads):
        assert rel_err(g, r) <= 2 * rel_err(s, r) + 1e-5, (name, rel_err(g, r), rel_err(s, r))
