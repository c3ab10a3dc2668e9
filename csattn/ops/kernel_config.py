"""Launch settings of the fused kernels as values: one frozen dataclass per op (``SparseAttnConfig``,
``IndexerConfig``, ``IndexerLossConfig``, ``MhcConfig``), handed to the host functions as ``config=``.

Nothing here reads the environment or keeps mutable state: a tuning run parses its variant string with
:meth:`KernelConfig.parse` and passes the result; the layer takes one from its ``AttentionConfig``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["KernelConfig"]

_C = TypeVar("_C", bound="KernelConfig")


class KernelConfig:
    """Shared helpers of the per-op kernel settings (subclasses are frozen dataclasses of int fields and bool
    flags; a flag is written ``0`` / ``1`` in a :meth:`parse` string)."""

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def _check_keys(cls, keys) -> None:
        known = cls.keys()
        for key in keys:
            if key not in known:
                raise ValueError(f"{cls.__name__}: unknown key {key!r} (known: {', '.join(known)})")

    @classmethod
    def parse(cls: type[_C], spec: str) -> _C:
        """``"bk_fwd=32,warps_fwd=4"`` -> the defaults with those fields set (an empty string: the defaults)."""
        flags = {f.name for f in dataclasses.fields(cls) if isinstance(f.default, bool)}
        values: dict[str, int | bool] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            cls._check_keys([key])
            if not sep:
                raise ValueError(f"{cls.__name__}: {item!r} is not key=value")
            try:
                values[key] = int(value)
            except ValueError:
                raise ValueError(f"{cls.__name__}: {key}={value!r} is not an int") from None
            if key in flags:
                if values[key] not in (0, 1):
                    raise ValueError(f"{cls.__name__}: {key} is a flag, 0 or 1, got {value!r}")
                values[key] = bool(values[key])
        return cls(**values)

    @classmethod
    def from_dict(cls: type[_C], values: dict[str, Any]) -> _C:
        """From :meth:`as_dict`'s output (a checkpoint or a JSON config); unknown keys raise naming the key."""
        cls._check_keys(values)
        return cls(**values)

    @classmethod
    def coerce(cls: type[_C], value: Any) -> _C | None:
        """None, an instance, a ``parse`` string or a ``from_dict`` mapping -> an instance (or None)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, dict):
            return cls.from_dict(value)
        raise TypeError(f"expected a {cls.__name__}, a 'key=value,...' string or a dict, got {type(value).__name__}")

    def replace(self: _C, **changes: Any) -> _C:
        type(self)._check_keys(changes)
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def spec(self) -> str:
        """The fields that differ from the defaults as a :meth:`parse` string (``""`` for the defaults)."""
        default = type(self)()
        return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.as_dict().items()
                        if getattr(default, k) != v)
