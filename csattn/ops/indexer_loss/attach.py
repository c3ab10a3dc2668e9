"""How the indexer loss trains the indexer inside the main backward: an identity on the attention output whose
backward also back-propagates the loss (``attach_indexer_loss``)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["IndexerLossAutoScaler", "attach_indexer_loss"]


class IndexerLossAutoScaler(torch.autograd.Function):
    """Identity on the attention output whose backward also sends ``d loss = scale`` into the indexer loss, so
    one ``backward()`` of the language-model loss trains the indexer without the KL appearing in the reported LM
    loss. ``scale`` is the main loss's scale (e.g. ``1 / num_microbatches``), given by the caller of the forward
    (the layer's ``indexer_loss_scale=`` argument); a tensor is read in the backward (no host sync)."""

    @staticmethod
    def forward(ctx, output: Tensor, loss: Tensor, scale: float | Tensor = 1.0) -> Tensor:
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (loss,) = ctx.saved_tensors
        scale = ctx.scale
        grad_loss = torch.ones_like(loss)
        if isinstance(scale, Tensor) or scale != 1.0:
            grad_loss = grad_loss * (scale.to(loss) if isinstance(scale, Tensor) else scale)
        return grad_output, grad_loss, None


def attach_indexer_loss(output: Tensor, loss: Tensor, scale: float | Tensor = 1.0) -> Tensor:
    """Return ``output`` unchanged; its backward also back-propagates ``loss`` with gradient ``scale`` (a number,
    or a 0-d tensor read in the backward)."""
    return IndexerLossAutoScaler.apply(output, loss, scale)
