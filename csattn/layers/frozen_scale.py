"""The indexer loss's gradient scale as the compiler sees it: a constant read when the forward is traced.

Its own module because ``torch.compiler.assume_constant_result`` imports ``torch._dynamo`` (and with it sympy and
Triton, about two seconds): :mod:`csattn.layers.op_sets` imports this module only when a capture-safe op set asks
for the scale, so ``import csattn`` stays light.
"""

from __future__ import annotations

import torch

from ..ops.indexer_loss import IndexerLossAutoScaler

__all__ = ["frozen_loss_scale"]


@torch.compiler.assume_constant_result
def frozen_loss_scale() -> float:
    """``IndexerLossAutoScaler``'s scale now (1.0 when unset), a constant to ``torch.compile``."""
    scale = IndexerLossAutoScaler.main_loss_backward_scale
    return 1.0 if scale is None else float(scale)
