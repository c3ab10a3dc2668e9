"""The reference runs in bf16 and fp32 too, close to the fp64 result within that dtype's rounding."""

import pytest
import torch

from csattn import PackedSeqs
from tests.helpers import random_layer, tiny_config


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
