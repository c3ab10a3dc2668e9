"""Autograd helpers shared by the ops: recomputing backward ops (the gradients of a function computed by running it
again under autograd, inside a ``torch.library`` custom op's implementation, where autograd is normally off; used
by the ops' ``custom_ops.py`` files and ``csattn.capture_safe``), and the named gradient tuples a backward returns
(:func:`named_grads`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

__all__ = ["autograd_vjp", "named_grads", "recording_autograd", "with_zero_grads"]

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


def named_grads(fn: Any) -> Callable[..., tuple]:
    """What a backward returns for ``fn``'s inputs, by name: ``grads(q=dq, kv=dkv)`` is a tuple with one slot per
    input of ``fn``, each named gradient in its input's slot, None in the others.

    ``fn``: a ``torch.autograd.Function`` class (its ``forward``'s arguments after ``ctx``) or a ``torch.library``
    custom op (its schema's arguments). Built once beside the function (``_Grads = named_grads(MyFunction)``), so a
    backward names its gradients instead of writing a positional tail of ``None``: a name that is not an input
    raises, and an input added to the forward cannot shift the gradients after it. The result is a plain tuple,
    not a named one: ``torch.compile`` drops the gradients of a backward that returns a named tuple.
    """
    if isinstance(fn, type) and issubclass(fn, torch.autograd.Function):
        names = tuple(inspect.signature(fn.forward).parameters)[1:]
    else:
        names = tuple(arg.name for arg in fn._opoverload._schema.arguments)
    slot = {name: i for i, name in enumerate(names)}

    def grads(**given: Tensor | None) -> tuple[Tensor | None, ...]:
        out: list[Tensor | None] = [None] * len(names)
        for name, grad in given.items():
            if name not in slot:
                raise TypeError(f"{name!r} is not an input of {fn!r} (its inputs: {', '.join(names)})")
            out[slot[name]] = grad
        return tuple(out)

    grads.inputs = names  # type: ignore[attr-defined]
    return grads


class _WithZeroGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: Tensor, *params: Tensor) -> Tensor:
        ctx.shapes = [(p.shape, p.dtype, p.device) for p in params]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return (grad, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes))


def with_zero_grads(out: Tensor, params: Sequence[Tensor]) -> Tensor:
    """``out`` unchanged, with zero gradients for ``params`` in its backward.

    For parameters a forward did not use on this rank's rows (a compressor when no document has a whole window):
    under FSDP every rank must reduce the same gradients, so an unused parameter gets an exact zero gradient
    instead of none. Unlike adding ``0 * p.sum()``, the output's values never depend on the parameters (an inf
    weight does not make it NaN)."""
    if not torch.is_grad_enabled() or not any(p.requires_grad for p in params):
        return out
    return _WithZeroGrads.apply(out, *params)
