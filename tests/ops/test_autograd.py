"""Backward returns name their gradients (``csattn.ops.autograd.named_grads``): one slot per input of the forward
(or of the custom op's schema), None where no gradient is named."""

from __future__ import annotations

import pytest
import torch

from csattn.ops.autograd import named_grads


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor, label):
        ctx.factor = factor
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        return _ScaleGrads(x=grad * ctx.factor)


_ScaleGrads = named_grads(_Scale)


def test_named_grads_fill_the_forward_inputs():
    assert _ScaleGrads.inputs == ("x", "factor", "label")
    assert _ScaleGrads(x=1) == (1, None, None) and type(_ScaleGrads(x=1)) is tuple
    with pytest.raises(TypeError, match="'y' is not an input"):
        _ScaleGrads(y=1)  # raises instead of landing in the wrong slot
    x = torch.ones(3, requires_grad=True)
    _Scale.apply(x, 2.0, "a").sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_named_grads_of_a_custom_op():
    from csattn.ops.sparse_attn.custom_ops import sparse_attn_op

    grads = named_grads(sparse_attn_op)
    assert grads.inputs[:4] == ("q", "kv", "indices", "sink")
    assert grads(q=1, sink=2) == (1, None, None, 2, None, None, None, None)
