"""No tensor of the reference path grows faster than linearly with the sequence length.

A dispatch mode records the largest tensor every op produces (forward and backward). With one long
document, quadrupling T must grow that maximum about 4x (``[T, k + W]`` gathers in bounded row chunks),
never 16x (a ``[T, T]`` mask, ``[H, T, T/r]`` scores or a dense ``[T, T + T/r]`` bias).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from csattn import PackedSeqs
from tests.helpers import random_layer, tiny_config


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def largest_tensor(layer_type: str, seqlen: int, **cfg) -> int:
    layer = random_layer(tiny_config(layer_type, **cfg), dtype=torch.float32)
    x = torch.randn(seqlen, 32, requires_grad=True)
    with LargestTensor() as mode:
        layer(x, packed=PackedSeqs.from_lengths([seqlen])).square().sum().backward()
    return mode.largest


@pytest.mark.slow  # several lengths of each layer
@pytest.mark.parametrize("layer_type", ["sliding", "csa", "hca"])
def test_largest_tensor_is_linear_in_length(layer_type):
    # small budgets so that chunking is what bounds the workspaces at these lengths
    cfg = dict(workspace_bytes=1 << 14, attn_chunk_rows=32, compress_ratio={"sliding": 0, "csa": 4, "hca": 4}[
        layer_type], index_topk=4)
    small = largest_tensor(layer_type, 128, **cfg)
    large = largest_tensor(layer_type, 512, **cfg)
    assert large <= 4.5 * small, f"largest tensor grew {large / small:.1f}x for 4x tokens"
