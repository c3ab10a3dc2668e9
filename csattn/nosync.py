"""A dispatch mode that fails on any op that would make a CUDA graph or ``torch.compile`` read device data on
the host: scalar reads (``.item()``, ``int(t)``, ``.tolist()``) and ops whose output shape depends on values."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

__all__ = ["HostSyncError", "NoHostSync", "HOST_SYNC_OPS", "host_reads_forbidden"]

_aten = torch.ops.aten
HOST_SYNC_OPS = frozenset({
    _aten._local_scalar_dense.default,  # .item(), int(t), bool(t), .tolist()
    _aten.nonzero.default,
    _aten.nonzero_static.default if hasattr(_aten, "nonzero_static") else _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.unique_dim.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
    _aten.repeat_interleave.Tensor,
    _aten.equal.default,
    _aten.is_nonzero.default,
    _aten.index.Tensor,  # only with a boolean index: checked below
    _aten.index_put_.default,
    _aten.index_put.default,
})


class HostSyncError(RuntimeError):
    """Raised by :class:`NoHostSync` on an op that reads device data on the host."""


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices if i is not None)


def _refuse(name: str):
    def refuse(self, *args, **kwargs):
        raise HostSyncError(f"Tensor.{name}() reads device data on the host")
    return refuse


def _to_host(func, args, kwargs) -> bool:
    """A copy from an accelerator tensor into host memory."""
    if func is _aten.copy_.default:
        dst, src = args[0], args[1]
        return src.device.type != "cpu" and dst.device.type == "cpu"
    device = kwargs.get("device")
    return args[0].device.type != "cpu" and device is not None and torch.device(device).type == "cpu"


class NoHostSync(TorchDispatchMode):
    """Raise :class:`HostSyncError` on host reads of device values and data-dependent output shapes.

    Indexing with an int tensor is fine; indexing with a bool mask (a hidden ``nonzero``) is not.
    ``nonzero_static`` has a static shape and is allowed. Works on CPU, so capture safety is testable
    without a GPU.
    """

    def __enter__(self):
        # On CPU ``.tolist()`` / ``.numpy()`` read memory without dispatching an op: catch them by name.
        self._saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name in self._saved:
            setattr(torch.Tensor, name, _refuse(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (_aten._to_copy.default, _aten.copy_.default) and _to_host(func, args, kwargs):
            raise HostSyncError(f"{func} copies a device tensor to the host")
        if func in (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default):
            if _bool_index(args):
                raise HostSyncError(f"{func} with a boolean mask has a data-dependent shape")
        elif func in HOST_SYNC_OPS and func is not getattr(_aten, "nonzero_static", _aten.nonzero).default:
            raise HostSyncError(f"{func} reads device data on the host")
        return func(*args, **kwargs)


def host_reads_forbidden(t: torch.Tensor | None = None) -> bool:
    """True while host reads of device values are not allowed: a CUDA graph is being captured on the current
    stream (``t`` on CUDA), ``torch.compile`` is tracing, or :class:`NoHostSync` (the CPU stand-in for both) is
    active. These are modes every rank of a job enters at the same point, unlike a per-object cache, so a
    collective skipped under them is skipped on every rank."""
    if torch.compiler.is_compiling():
        return True
    if t is not None and t.is_cuda and torch.cuda.is_current_stream_capturing():
        return True
    return any(isinstance(mode, NoHostSync) for mode in _get_current_dispatch_mode_stack())
