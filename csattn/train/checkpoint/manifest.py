"""Checkpoint manifests: ``manifest.json`` lists every file of a checkpoint (the DCP shards and their ``.metadata``,
the trainer state, the HF export, the tokenizer's files) with its size and sha256. It is written last, atomically,
once every rank's files are on disk, so a checkpoint without one is incomplete (its save did not finish); a file
missing, of another size or with another sha256 than its manifest says makes the checkpoint damaged.

Hashing reads the whole checkpoint once per save and once per resume; under torch.distributed the files are split
over the ranks (the largest first, round-robin), which hash their share in parallel, so the cost is about the
checkpoint's size over the ranks' combined read rate. Both functions are collectives under torch.distributed (the
default group) and give every rank the same answer: rank 0 lists the files and reads the manifest, and every
rank's findings are gathered before anyone decides. The checkpoint directory must be visible to every rank (one
file system), as it already is for resuming on another mesh.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch.distributed as dist

__all__ = ["MANIFEST", "INCOMPLETE", "write_manifest", "discard_manifest", "verify_checkpoint", "from_rank0",
           "gather_objects"]

MANIFEST = "manifest.json"
# verify_checkpoint's answer for a checkpoint without a manifest
INCOMPLETE = (f"no {MANIFEST} (written last, once every file is on disk): its save did not finish, or an older csattn "
              "wrote it")
_FORMAT = "csattn-checkpoint-manifest-1"
_CHUNK = 8 << 20  # bytes read at a time while hashing


def write_manifest(path: str, step: int) -> None:
    """Hash every file under ``path`` and write ``path/manifest.json`` (temporary file, fsync, rename). A collective:
    call it on every rank once every rank's files of the checkpoint are written (after a barrier)."""
    rank, world = _rank_world()
    files = from_rank0(_listing(path) if rank == 0 else None)
    mine: dict[str, Any] = {}
    for name in _share(files, rank, world):
        file = os.path.join(path, name)
        try:
            mine[name] = {"size": os.path.getsize(file), "sha256": _sha256(file)}
        except OSError as e:  # gathered first, so every rank fails alike instead of some waiting
            mine[name] = f"{name}: {e}"
    entries: dict[str, Any] = {}
    for part in gather_objects(mine, world):
        entries.update(part)
    failed = sorted(v for v in entries.values() if isinstance(v, str))
    if failed:
        raise OSError(f"writing the manifest of checkpoint {path}: cannot read {failed[0]}")
    if rank == 0:
        tmp = os.path.join(path, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"format": _FORMAT, "step": step, "files": dict(sorted(entries.items()))}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, MANIFEST))


def discard_manifest(path: str) -> None:
    """Remove ``path/manifest.json`` if there is one (before a save overwrites the checkpoint: until the new
    manifest is written it is incomplete, not intact with the old one's files)."""
    try:
        os.remove(os.path.join(path, MANIFEST))
    except FileNotFoundError:
        pass


def verify_checkpoint(path: str, deep: bool = True, collective: bool = True) -> str | None:
    """None if checkpoint ``path`` is intact, else why not, in a few words (:data:`INCOMPLETE` without a manifest; an
    unreadable manifest; the first file missing or of another size; with ``deep``, the first whose sha256 differs).
    Sizes are checked on every file before any is hashed, so a truncated file is found without reading the
    checkpoint. ``collective``: a collective under torch.distributed (every rank returns the same answer); else this
    process alone checks every file."""
    rank, world = _rank_world() if collective else (0, 1)
    files = from_rank0(_read_manifest(path) if rank == 0 else None, world)
    if isinstance(files, str):
        return files
    names = sorted(files, key=lambda n: (-files[n]["size"], n))
    for check in (_size_problem, _hash_problem) if deep else (_size_problem,):
        found = [p for n in _share(names, rank, world) if (p := check(path, n, files[n])) is not None]
        everyone = sorted(p for part in gather_objects(found, world) for p in part)
        if everyone:
            more = f" (and {len(everyone) - 1} other file(s))" if len(everyone) > 1 else ""
            return everyone[0][1] + more
    return None


def _read_manifest(path: str) -> dict[str, dict[str, Any]] | str:
    """The manifest's files, or why there is none to trust."""
    where = os.path.join(path, MANIFEST)
    if not os.path.isfile(where):
        return INCOMPLETE
    try:
        with open(where) as f:
            data = json.load(f)
        files = data["files"]
        ok = data.get("format") == _FORMAT and isinstance(files, dict) and all(
            _inside(n) and isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
            for n, e in files.items())
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    return files if ok else f"{MANIFEST} is not a csattn checkpoint manifest ({_FORMAT})"


def _inside(name: Any) -> bool:
    """A relative path that stays inside the checkpoint (a manifest never makes us read other files)."""
    return isinstance(name, str) and bool(name) and not os.path.isabs(name) and ".." not in name.split("/")


def _size_problem(path: str, name: str, entry: dict[str, Any]) -> tuple[str, str] | None:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        return name, f"{name} is missing"
    try:
        size = os.path.getsize(file)
    except OSError as e:  # an answer, not an exception: the other ranks wait for this one's
        return name, f"{name} is unreadable ({e})"
    if size != entry["size"]:
        cut = " (truncated)" if size < entry["size"] else ""
        return name, f"{name} is {size} bytes, its manifest says {entry['size']}{cut}"
    return None


def _hash_problem(path: str, name: str, entry: dict[str, Any]) -> tuple[str, str] | None:
    try:
        digest = _sha256(os.path.join(path, name))
    except OSError as e:
        return name, f"{name} is unreadable ({e})"
    if digest != entry["sha256"]:
        return name, f"{name} has another sha256 than its manifest says (changed after the save)"
    return None


def _listing(path: str) -> list[str]:
    """Every file under ``path`` (relative, '/'-separated), largest first; not the manifest nor temporary files."""
    found = []
    for root, _, names in os.walk(path):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), path).replace(os.sep, "/")
            if rel != MANIFEST and not n.endswith(".tmp"):
                found.append((-os.path.getsize(os.path.join(root, n)), rel))
    return [rel for _, rel in sorted(found)]


def _sha256(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _share(names: list[str], rank: int, world: int) -> list[str]:
    return names[rank::world]


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def from_rank0(obj: Any, world: int | None = None) -> Any:
    """Rank 0's ``obj`` on every rank (a collective under torch.distributed, unless ``world`` is 1)."""
    if (world if world is not None else _rank_world()[1]) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: Any, world: int) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` in one process; a collective otherwise)."""
    if world == 1:
        return [obj]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, obj)
    return everyone
