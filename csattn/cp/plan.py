"""Per-rank index plan of one layer geometry over one global packed stream, and the collective input check.

Everything is derived from the global metadata (no communication), once per packed stream and geometry,
and cached on the ``PackedSeqs``. Index spaces:

* *local* rows: this rank's ``L = T / P`` rows, its segments in stream order;
* *ext* rows: per segment, its left halo (the ``Hh`` rows before it, received from their owner) followed by
  the segment's own rows. Raw KV and the compressors run on ext rows; window ids point into them;
* *global* compressed ids: the single-process entry order (``PackedSeqs.compress``); the gathered
  compressed KV / indexer keys are put back in this order, so top-k, visibility limits and the loss use the
  same ids as the single-process layer.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from ..config import AttentionConfig
from ..layers.op_sets import EAGER
from ..layers.plan import IDENTITY, Entries, LayerPlan
from ..packing import PackedSeqs
from .exchange import GatherIndex
from .partition import halo_rows, make_layout, num_chunks

__all__ = ["build_plan", "check_inputs", "agree"]


def _geometry_key(cfg: AttentionConfig) -> tuple:
    return (cfg.layer_type, cfg.sliding_window, cfg.compress_ratio if cfg.has_compressor else 0)


def _fingerprint(packed: PackedSeqs, extra: tuple) -> int:
    h = hashlib.blake2b(digest_size=7)
    for cu in (packed.cu_seqlens_padded, packed.cu_seqlens):
        h.update(cu.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
        h.update(b"|")
    h.update(repr(extra).encode())
    return int.from_bytes(h.digest(), "little")


def _local_verdict(x_local: Tensor, packed: PackedSeqs, cfg: AttentionConfig, cp) -> tuple[int, str, int, int]:
    """This rank's ``(error code, detail, num_rows, fingerprint)``: pure local work, no communication, so it
    may be cached on ``packed`` (``PackedSeqs.cache`` empties itself when a prefix sum is edited in place)."""
    size = cp.size
    halo = halo_rows(cfg)
    key = ("cp-verdict", size, cp.partition, cp.chunks_per_rank, _geometry_key(cfg), x_local.shape[0],
           str(x_local.device))
    cache = packed.cache()
    if key in cache:
        return cache[key]
    chunks = num_chunks(cp.partition, size, cp.chunks_per_rank)
    code, detail = 0, ""
    try:
        num_rows = packed.num_rows
        packed.validate(num_rows, packed.cu_seqlens_padded.device)
    except (ValueError, TypeError, IndexError, RuntimeError) as err:
        code, detail, num_rows = 4, str(err), -1
    if code == 0 and num_rows % chunks:
        code = 3
    elif code == 0 and x_local.shape[0] * size != num_rows:
        code = 2
    elif code == 0 and size > 1 and num_rows // chunks < halo:
        code = 1
    try:
        fp = _fingerprint(packed, (cp.partition, cp.chunks_per_rank, _geometry_key(cfg)))
    except Exception:  # unreadable metadata: code 4 already says so
        fp = 0
    verdict = (code, detail, num_rows, fp)
    if code == 0:  # a failing verdict is recomputed next time (the caller may fix the object)
        cache[key] = verdict
    return verdict


def agree(code: int, fingerprint: int, device: torch.device, group) -> tuple[int, bool]:
    """The one collective of the CP input checks: a ``[3]`` int64 all-reduce (max) of ``[code, fp, -fp]`` gives
    the worst problem code of any rank and whether every rank's fingerprint of the metadata and layer is the
    same. Every rank calls it on every checked call, so no rank is left waiting in it alone."""
    flags = torch.tensor([code, fingerprint, -fingerprint], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    worst, fp_max, neg_fp_min = flags.tolist()
    return worst, fp_max == -neg_fp_min


def check_inputs(x_local: Tensor, packed: PackedSeqs, cfg: AttentionConfig, cp) -> None:
    """Validate on every rank, agree on the worst problem with one all-reduce, then raise the same
    ``ValueError`` everywhere (so no rank is left waiting in a collective).

    The all-reduce runs on every call: whether a rank communicates must never depend on what its local caches
    hold (one rank reusing a ``PackedSeqs`` it already checked while another passes a fresh, equal one would
    otherwise leave the second waiting in the all-reduce until the process-group timeout). Only the local
    validation and fingerprint are cached; the collective is one ``[3]`` int64 all-reduce per layer."""
    size = cp.size
    halo = halo_rows(cfg)
    chunks = num_chunks(cp.partition, size, cp.chunks_per_rank)
    code, detail, num_rows, fp = _local_verdict(x_local, packed, cfg, cp)
    code, same = agree(code, fp, x_local.device, cp.group)
    if not same:
        raise ValueError(
            "context parallelism: the global packed metadata (cu_seqlens / cu_seqlens_padded) or the layer "
            "geometry differs across the ranks of the CP group; every rank must pass the same global "
            "packed metadata and run the same layer"
        )
    if code == 4:
        raise ValueError(f"context parallelism: invalid packed metadata: {detail or 'rejected on another rank'}")
    if code == 3:
        raise ValueError(
            f"context parallelism: the packed stream has {num_rows} rows, which do not split into {chunks} "
            f"equal chunks ({cp.partition!r} partition over {size} ranks); pad the documents "
            f"(cu_seqlens_padded) to a multiple of {chunks} rows"
        )
    if code == 2:
        raise ValueError(
            f"context parallelism: hidden_states must hold this rank's {num_rows // size} rows of the "
            f"{num_rows}-row global stream (use cp.shard(x, packed)); a rank passed a different number"
        )
    if code == 1:
        raise ValueError(
            f"context parallelism: a shard chunk of {num_rows // chunks} rows is shorter than the "
            f"{halo}-row left halo of this {cfg.layer_type} layer (window {cfg.sliding_window}"
            + (f", ratio {cfg.compress_ratio}" if cfg.has_compressor else "")
            + f"); use fewer ranks or chunks, or a longer stream (at least {halo * chunks} rows)"
        )


def build_plan(packed: PackedSeqs, cfg: AttentionConfig, cp, device: torch.device) -> tuple[LayerPlan, GatherIndex]:
    """This rank's :class:`LayerPlan` (its exchange still the identity) and the host index of its exchange (cached on
    ``packed``). Assumes :func:`check_inputs` passed."""
    size, rank = cp.size, cp.rank
    key = ("cp-plan", size, rank, cp.partition, cp.chunks_per_rank, id(cp.cost_config), _geometry_key(cfg),
           str(device))
    cached = packed.cache().get(key)
    if cached is not None:
        return cached
    layout = make_layout(packed, cp.partition, size, cp.chunks_per_rank, cp.cost_config)
    halo = halo_rows(cfg) if size > 1 else 0
    all_segs = [layout.segments(r) for r in range(size)]
    segs = all_segs[rank]
    num_segments = max(len(s) for s in all_segs)

    # tails this rank publishes: the last Hh rows of each of its segments (slots padded to num_segments)
    tail_index = None
    if halo > 0:
        tails, off = [], 0
        for a, b in segs:
            off += b - a
            tails.append(torch.arange(off - halo, off))
        tails += [torch.zeros(halo, dtype=torch.int64)] * (num_segments - len(segs))
        tail_index = torch.cat(tails).to(device)
    # where each (rank, segment) ends, to find who holds the rows before one of our segments
    end_to_slot = {b: (r * num_segments + j) * halo for r, ss in enumerate(all_segs) for j, (_, b) in enumerate(ss)}

    pieces: list[tuple[str, int, int]] = []
    ext_rows, local_rows, local_in_ext, seg_ext = [], [], [], []
    n_ext = off = 0
    for a, b in segs:
        h = halo if a > 0 else 0
        if h:
            pieces.append(("halo", end_to_slot[a], h))
            ext_rows.append(torch.arange(a - h, a))
        pieces.append(("local", off, b - a))
        ext_rows.append(torch.arange(a, b))
        local_rows.append(torch.arange(a, b))
        local_in_ext.append(torch.arange(n_ext + h, n_ext + h + b - a))
        seg_ext.append((a, b, n_ext + h - a))  # ext id of global row g in this segment = g + shift
        n_ext += h + b - a
        off += b - a
    ext_rows_t = torch.cat(ext_rows)
    local_rows_t = torch.cat(local_rows)
    local_in_ext_t = torch.cat(local_in_ext)

    rows = packed.rows(torch.device("cpu"))
    pos_local, real_local = rows.pos[local_rows_t], rows.real[local_rows_t]
    offs = torch.arange(-cfg.sliding_window + 1, 1)
    valid = (pos_local[:, None] + offs[None, :] >= 0) & real_local[:, None]
    window_ids = torch.where(valid, local_in_ext_t[:, None] + offs[None, :], -1)

    entries = None
    index = GatherIndex(halo=halo, tail_index=tail_index, pieces=pieces)
    if cfg.has_compressor:
        r = cfg.compress_ratio
        meta = packed.compress(r, torch.device("cpu"))
        owner = layout.owner(meta.entry_row + r - 1)  # a group belongs to the rank holding its last token
        counts = torch.bincount(owner, minlength=size)
        max_owned = int(counts.max()) if owner.numel() else 0
        order = torch.argsort(owner, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.empty_like(owner)
        slot[order] = torch.arange(owner.numel()) - starts[owner[order]]
        mine = (owner == rank).nonzero().flatten()  # ascending global ids
        last = meta.entry_row[mine] + r - 1
        shift = torch.zeros_like(last)
        for a, b, s in seg_ext:
            shift = torch.where((last >= a) & (last < b), torch.full_like(last, s), shift)
        local_meta = replace(
            meta,
            entry_row=(meta.entry_row[mine] + shift).to(device),
            entry_first=meta.entry_first[mine].to(device),
            entry_pos=meta.entry_pos[mine].to(device),
            num_entries=int(mine.numel()),
        )
        entries = Entries(local_meta, meta.vis_start[local_rows_t].to(device), meta.vis_end[local_rows_t].to(device),
                          meta.max_visible)
        index = replace(index, num_entries=meta.num_entries, num_owned=int(mine.numel()), max_owned=max_owned,
                        gathered_order=(owner * max_owned + slot).to(device))
    plan = (LayerPlan(pos_local.to(device), real_local.to(device), rows.num_real, window_ids.to(device), IDENTITY,
                      EAGER, pos_ext=rows.pos[ext_rows_t].to(device), entries=entries,
                      padding=not bool(real_local.all())), index)
    packed.cache()[key] = plan
    return plan
