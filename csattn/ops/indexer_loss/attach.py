"""How the indexer loss trains the indexer inside the main backward: an identity on the attention output whose
backward also back-propagates the loss (``attach_indexer_loss``)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["IndexerLossAutoScaler", "attach_indexer_loss"]


class IndexerLossAutoScaler(torch.autograd.Function):
    """Identity on the attention output whose backward also sends ``d loss = loss_scale`` into the indexer
    loss, so one ``backward()`` of the language-model loss trains the indexer without the KL appearing in
    the reported LM loss. ``set_loss_scale`` sets the main loss's scale (e.g. ``1 / num_microbatches``); it is
    read in the backward unless ``apply`` is given a fixed ``scale`` (captured graphs, ``torch.compile``)."""

    main_loss_backward_scale: float | Tensor | None = None

    @staticmethod
    def forward(ctx, output: Tensor, loss: Tensor, scale: float | None = None) -> Tensor:
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (loss,) = ctx.saved_tensors
        scale = ctx.scale if ctx.scale is not None else IndexerLossAutoScaler.main_loss_backward_scale
        grad_loss = torch.ones_like(loss)
        if scale is not None:
            grad_loss = grad_loss * (scale.to(loss) if isinstance(scale, Tensor) else scale)
        return grad_output, grad_loss, None

    @staticmethod
    def set_loss_scale(scale: float | Tensor) -> None:
        """Scale of the gradient injected into every attached indexer loss (default 1). A number is kept as a
        number, so the capture-safe forward, which reads the scale on the host, never reads a tensor for it."""
        IndexerLossAutoScaler.main_loss_backward_scale = scale if isinstance(scale, Tensor) else float(scale)


def attach_indexer_loss(output: Tensor, loss: Tensor, scale: float | None = None) -> Tensor:
    """Return ``output`` unchanged; its backward also back-propagates ``loss`` with the loss scale (the one
    set by ``IndexerLossAutoScaler.set_loss_scale`` at backward time, or ``scale`` when given)."""
    return IndexerLossAutoScaler.apply(output, loss, scale)
