"""Recomputing backward ops: the gradients of a function computed by running it again under autograd, inside a
``torch.library`` custom op's implementation (where autograd is normally off). Shared by the ops'
``custom_ops.py`` files and ``csattn.graphs``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["autograd_vjp", "recording_autograd"]

_K = torch._C.DispatchKey
_AUTOGRAD_KEYS = (_K.AutogradOther, _K.AutogradNestedTensor, _K.AutogradCPU, _K.AutogradCUDA)


@contextmanager
def recording_autograd():
    """Record autograd inside a custom op's implementation.

    A custom op's implementation runs below the autograd dispatch key (it is excluded in the thread-local
    state), so ``torch.autograd.grad`` would see no graph. Lifting the exclusion for this block, with grad
    mode on, lets a backward op differentiate the forward it recomputes.
    """
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def autograd_vjp(
    fn: Callable[..., Tensor | Sequence[Tensor]],
    inputs: Sequence[Tensor],
    differentiable: Sequence[bool],
    grad_outputs: Sequence[Tensor | None],
) -> list[Tensor]:
    """Gradients of ``fn(*inputs)`` w.r.t. the ``differentiable`` inputs (zeros for the others).

    ``grad_outputs`` pairs with ``fn``'s outputs; a ``None`` gradient (an output nobody used) is skipped.
    """
    with recording_autograd():
        leaves = [t.detach().requires_grad_(d) for t, d in zip(inputs, differentiable)]
        outs = fn(*leaves)
        outs = (outs,) if isinstance(outs, Tensor) else tuple(outs)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
        wrt = [t for t in leaves if t.requires_grad]
        grads = iter(())
        if pairs and wrt:
            grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))
    result = []
    for t in leaves:
        g = next(grads, None) if t.requires_grad else None
        result.append(torch.zeros_like(t) if g is None else g.detach())
    return result
