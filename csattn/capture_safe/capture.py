"""One training step of an attention layer (forward + backward) captured in a CUDA graph.

The graph reads its inputs from static buffers (hidden states, output gradient, both ``cu_seqlens``), so a
new pack is run by copying into them and replaying: the metadata is rebuilt inside the graph from the
device prefix sums. Every pack must keep the captured ``T``, number of documents and ``max_seqlen`` bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..packing_capture_safe import CaptureSafePackedSeqs

if TYPE_CHECKING:
    from ..layers.plan import ContextParallelGroup

__all__ = ["CapturedLayerStep"]


class CapturedLayerStep:
    """Capture ``y = layer(x, packed); y.backward(dy)`` once, then replay it on new packs.

    Args:
        layer: a ``HybridAttention`` on a CUDA device (its ``capture_safe`` flag need not be set: a
            :class:`CaptureSafePackedSeqs` routes to the capture-safe path).
        x, dy: ``[T, D]`` example hidden states and output gradient (copied into static buffers).
        cu_seqlens, cu_seqlens_padded: ``[N+1]`` example pack (copied into static buffers).
        max_seqlen: host bound on the longest physical document of every pack to be replayed.
        warmup: eager steps on a side stream before capture (Triton compiles its kernels there).
        indexer_loss_scale: the layer's ``indexer_loss_scale`` in the captured step (a number is fixed at capture;
            a 0-d CUDA tensor is read by every replay).
        cp: optional ``csattn.ContextParallel`` (contiguous partition): ``x`` / ``dy`` are this rank's rows and
            the pack is the global stream (``T = P * x.shape[0]`` rows). Every rank captures its own graph and
            all ranks replay together. The collectives are captured too, which needs a backend that supports
            CUDA-graph capture (NCCL across GPUs); gloo (several ranks on one GPU) copies through host memory
            and cannot be captured.

    After :meth:`replay`, ``self.y`` holds the output, ``self.x_grad`` and ``self.grads`` (by parameter name,
    also bound to each parameter's ``.grad``) the gradients of that step; the next replay overwrites them, so
    clone what you keep.

    Example:
        >>> step = CapturedLayerStep(layer, x, dy, cu, cu_pad, max_seqlen=4096)
        >>> y = step.replay(x2, dy2, cu2, cu_pad2)
    """

    def __init__(self, layer: nn.Module, x: Tensor, dy: Tensor, cu_seqlens: Tensor, cu_seqlens_padded: Tensor,
                 max_seqlen: int, warmup: int = 3, cp: ContextParallelGroup | None = None,
                 indexer_loss_scale: float | Tensor = 1.0) -> None:
        if not x.is_cuda:
            raise ValueError("CapturedLayerStep needs CUDA tensors (x is on the CPU)")
        if dy.shape != x.shape:
            raise ValueError(f"dy must have the shape of x {tuple(x.shape)}, got {tuple(dy.shape)}")
        self.layer = layer
        self.cp = cp
        self.indexer_loss_scale = indexer_loss_scale
        self.num_rows = x.shape[0] * (cp.size if cp is not None else 1)
        self.max_seqlen = int(max_seqlen)
        self.x = x.detach().clone().requires_grad_()
        self.dy = dy.detach().clone()
        self.cu = cu_seqlens.detach().clone()
        self.cu_pad = cu_seqlens_padded.detach().clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._zero_grads()
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self._zero_grads()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.y = self._step()
        # the graph writes these buffers on every replay (eager steps in between may rebind p.grad)
        self.x_grad = self.x.grad
        self.grads = {name: p.grad for name, p in layer.named_parameters() if p.grad is not None}

    def _zero_grads(self) -> None:
        # grads start as None so the captured backward allocates them in the graph's pool and writes them
        self.x.grad = None
        for p in self.layer.parameters():
            p.grad = None

    def _step(self) -> Tensor:
        packed = CaptureSafePackedSeqs(self.cu, self.cu_pad, num_rows=self.num_rows, max_seqlen=self.max_seqlen)
        y = self.layer(self.x, packed=packed, cp=self.cp, indexer_loss_scale=self.indexer_loss_scale)
        y.backward(self.dy)
        return y.detach()

    def replay(self, x: Tensor | None = None, dy: Tensor | None = None, cu_seqlens: Tensor | None = None,
               cu_seqlens_padded: Tensor | None = None) -> Tensor:
        """Copy the given inputs into the static buffers (the others keep their values) and replay."""
        with torch.no_grad():
            for src, dst in ((x, self.x), (dy, self.dy), (cu_seqlens, self.cu), (cu_seqlens_padded, self.cu_pad)):
                if src is not None:
                    if src.shape != dst.shape:
                        raise ValueError(f"replay input of shape {tuple(src.shape)} does not match the captured "
                                         f"{tuple(dst.shape)}")
                    dst.copy_(src)
        self.graph.replay()
        self.x.grad = self.x_grad
        for name, p in self.layer.named_parameters():
            if name in self.grads:
                p.grad = self.grads[name]
        return self.y
