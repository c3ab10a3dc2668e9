"""The reference runs in bf16 and fp32 too, close to the fp64 result within that dtype's rounding."""

import pytest
import torch

from csattn import PackedSeqs
from tests.helpers import random_layer, rel_err, tiny_config


@pytest.mark.parametrize("layer_type", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_low_precision_close_to_fp64(layer_type, dtype, tol, assert_close):
    packed = PackedSeqs.from_lengths([19, 2, 33])
    ref = random_layer(tiny_config(layer_type))
    low = random_layer(tiny_config(layer_type)).to(dtype)
    x = torch.randn(54, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x64, xlo = x.clone().requires_grad_(), x.to(dtype).requires_grad_()
    y64, ylo = ref(x64, packed=packed), low(xlo, packed=packed)
    assert ylo.dtype == dtype
    y64.sum().backward()
    ylo.float().sum().backward()
    assert_close(ylo, y64, tol, "output")
    assert_close(xlo.grad, x64.grad, 3 * tol, "input grad")
    # bf16 can flip a near-tie in the indexer's top-k, so only the attention weights' grads are compared
    for name in ("q_b_proj.weight", "kv_proj.weight", "o_b_proj.weight", "sinks"):
        assert_close(low.get_parameter(name).grad, ref.get_parameter(name).grad, 3 * tol, name)


def _cast_like_training_dtype(layer: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``layer`` cast as ``to_training_dtype`` casts a model: sinks, position biases and norm weights
    stay fp32."""
    import copy

    from csattn.amp import keeps_fp32

    low = copy.deepcopy(layer)
    for name, p in low.named_parameters():
        if not keeps_fp32(name):
            p.data = p.data.to(dtype)
    return low


GPU = pytest.mark.gpu
AUTOCAST = [("cpu", torch.bfloat16), pytest.param("cuda", torch.bfloat16, marks=GPU),
            pytest.param("cuda", torch.float16, marks=GPU)]


@pytest.mark.parametrize("layer_type", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("recompute", [True, False], ids=["blocked", "unblocked"])
@pytest.mark.parametrize("device,dtype", AUTOCAST, ids=["cpu_bf16", "cuda_bf16", "cuda_fp16"])
def test_autocast_is_the_layer_cast_to_its_dtype(layer_type, recompute, device, dtype):
    """Under ``torch.autocast`` the layer with fp32 weights computes what the same layer cast to the autocast
    dtype (norms, sinks and position biases fp32) computes on the input cast to it, forward and backward: the
    fused ops' backward recomputations run outside autocast, so the layer fixes its dtypes once. Bit for bit on
    the CPU; on CUDA the forward bit for bit and the gradients to the run-to-run order of the backward's fp32
    atomics. Before, the grouped output projection's ``bmm(out=)`` failed on autocast's operands."""
    packed = PackedSeqs.from_lengths([19, 2, 33], padded_lengths=[20, 2, 36], device=device)
    layer = random_layer(tiny_config(layer_type, recompute_projections=recompute), dtype=torch.float32).to(device)
    low = _cast_like_training_dtype(layer, dtype)
    gen = torch.Generator().manual_seed(0)
    x, dy = torch.randn(58, 32, generator=gen).to(device), torch.randn(58, 32, generator=gen).to(device)
    xa, xl = x.clone().requires_grad_(), x.to(dtype).requires_grad_()
    with torch.autocast(device, dtype=dtype):
        ya = layer(xa, packed=packed)
    yl = low(xl, packed=packed)
    assert ya.dtype == dtype and torch.equal(ya, yl)
    (ya.float() * dy).sum().backward()
    (yl.float() * dy).sum().backward()

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b) if device == "cpu" else rel_err(a, b) <= 1e-2

    assert xa.grad.dtype == torch.float32 and same(xa.grad, xl.grad.float())
    if layer.last_indexer_loss is not None:
        assert same(layer.last_indexer_loss, low.last_indexer_loss)
    for name, p in layer.named_parameters():
        q = low.get_parameter(name)
        assert p.dtype == torch.float32, name  # the master weights are untouched
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad.dtype == torch.float32 and same(p.grad, q.grad.float()), name
