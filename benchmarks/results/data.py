"""The page's JSON files, read: the runner's (``{"meta", "results"}``), the scaling report's parts and the sharded
training file, plus the number formats every table shares."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Results", "tok", "num", "gib", "times", "commit_of"]


def commit_of(record: dict, meta: dict | None) -> str:
    """The commit a record was measured at: its own (merged files name one per record) or its file's."""
    return str(record.get("commit") or (meta or {}).get("commit") or "unknown")


@dataclass
class Results:
    """Every ``*.json`` of one folder, by file name."""

    json_dir: Path
    files: dict[str, dict]

    @classmethod
    def load(cls, json_dir: Path) -> Results:
        files = {}
        for path in sorted(Path(json_dir).glob("*.json")):
            with open(path) as f:
                files[path.name] = json.load(f)
        return cls(Path(json_dir), files)

    def meta(self, name: str) -> dict | None:
        data = self.files.get(name)
        return data.get("meta") if isinstance(data, dict) else None

    def records(self, name: str, **match) -> list[dict]:
        """The records of file ``name`` (none if it is missing) whose fields equal ``match`` (``tokens`` and the
        other shape options are looked up in ``shape``), each with its ``commit``."""
        data = self.files.get(name)
        if not isinstance(data, dict):
            return []
        out = []
        for rec in data.get("results", data.get("records", [])):
            fields = {**rec.get("shape", {}), **rec}
            if all(fields.get(k) == v for k, v in match.items()):
                out.append({**rec, "commit": commit_of(rec, data.get("meta"))})
        return out

    def one(self, name: str, **match) -> dict | None:
        """The first record of ``records(name, **match)`` that has a time, else None."""
        return next((r for r in self.records(name, **match) if r.get("ms") is not None), None)


def tok(n: int) -> str:
    """``16384`` -> ``16k``; ``524288`` -> ``512k``."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def num(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def gib(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def times(v: float | None) -> str:
    """A ratio as ``12.3x`` (``-`` when unknown)."""
    return "-" if v is None else (f"{v:.2f}x" if v < 10 else f"{v:.1f}x")


def ms(v: float | None) -> str:
    """Milliseconds with three significant digits or more."""
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}" if v < 10000 else f"{v:,.0f}"
