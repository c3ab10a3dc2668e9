"""Per-document isolation checks: a NaN / Inf planted in one row (real or padding) must change nothing outside
its document, neither outputs nor input-gradient rows; planted in padding rows only, it must not reach any
parameter gradient either (padding is not data). Shared by the single-process tests, the fuzz test and the
context-parallel ranks (``tests/cp_pool.py``)."""

from __future__ import annotations

import torch
from torch import Tensor

from csattn import ContextParallel, PackedSeqs

from .cp_tasks import build_stack


def affected_rows(packed: PackedSeqs, bad_rows: list[int]) -> Tensor:
    """``[T]`` bool: rows allowed to change when ``bad_rows`` are poisoned. A poisoned real row may change its
    whole document (later rows attend to it); a poisoned padding row only itself (padding is never a key)."""
    rows = packed.rows(torch.device("cpu"))
    out = torch.zeros(packed.num_rows, dtype=torch.bool)
    for r in bad_rows:
        if bool(rows.real[r]):
            out |= rows.doc == rows.doc[r]
        else:
            out[r] = True
    return out


def run_stack(layers: torch.nn.ModuleList, x: Tensor, g: Tensor, packed, cp: ContextParallel | None = None
              ) -> tuple[Tensor, Tensor]:
    """Residual stack output and the input gradient of ``sum(out * g)``."""
    x = x.detach().clone().requires_grad_()
    h = x
    for layer in layers:
        h = h + layer(h, packed=packed, cp=cp)
    (h * g).sum().backward()
    return h.detach(), x.grad.detach()


def isolation_errors(layers: torch.nn.ModuleList, packed_fn, x: Tensor, g: Tensor, bad: list[tuple[int, float]],
                     cp: ContextParallel | None = None) -> list[str]:
    """Run clean and poisoned (``x[row] = value`` for each ``(row, value)``) and list every violation: a row
    outside the affected documents whose output or input gradient is non-finite or differs from the clean
    run (bit for bit: the same ops on the same shapes, only other rows' values changed).

    ``packed_fn()`` makes a fresh metadata object per run (nothing cached across the two runs). Under ``cp``
    ``x`` / ``g`` are the global tensors; each rank checks its own rows.
    """
    packed = packed_fn()
    poisoned = x.clone()
    for row, value in bad:
        poisoned[row] = value
    allowed = affected_rows(packed, [r for r, _ in bad])
    if cp is not None:
        shard = cp.local_rows(packed)
        allowed = allowed[shard]
        x, poisoned, g = cp.shard(x, packed), cp.shard(poisoned, packed), cp.shard(g, packed)
    out_c, dx_c = run_stack(layers, x, g, packed_fn(), cp)
    grads_c = _take_grads(layers)
    out_p, dx_p = run_stack(layers, poisoned, g, packed_fn(), cp)
    grads_p = _take_grads(layers)
    keep = ~allowed
    problems = []
    rows = packed.rows(torch.device("cpu"))
    if not any(bool(rows.real[r]) for r, _ in bad):
        # only padding poisoned: every parameter gradient (this rank's) is finite and bit for bit the clean one
        for name, clean in grads_c.items():
            dirty = grads_p[name]
            if not torch.isfinite(dirty).all() or not torch.equal(dirty, clean):
                problems.append(f"parameter gradient {name} changed by poisoned padding rows {bad}")
    for what, clean, dirty in (("output", out_c, out_p), ("input grad", dx_c, dx_p)):
        if not torch.isfinite(clean[keep]).all():
            problems.append(f"clean run: non-finite {what}")
        bad_rows = (~torch.isfinite(dirty) | (dirty != clean)).any(dim=1) & keep
        if bad_rows.any():
            problems.append(f"{what} rows {bad_rows.nonzero().flatten().tolist()[:8]} changed "
                            f"(planted {bad}, allowed rows {allowed.nonzero().flatten().tolist()[:16]}...)")
    return problems


def _take_grads(layers: torch.nn.ModuleList) -> dict[str, Tensor]:
    """Every parameter gradient (zeros where none), then cleared for the next run."""
    out = {}
    for name, p in layers.named_parameters():
        out[name] = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        p.grad = None
    return out


def cp_isolation(group, lengths, pads, partition, types, bad, seed=0, dtype="float64", pad_only=False,
                 **over) -> list[str]:
    """:func:`isolation_errors` on this rank of a CP group (the pack padded to whole chunks). ``bad`` rows are
    taken modulo the rows, or with ``pad_only`` modulo the padding rows (at least one: ``pads`` gives some)."""
    import torch.distributed as dist

    from .cp_tasks import padded_pack

    size = dist.get_world_size(group)
    # CP size 1 runs the single-process layer (cp=None), the path most users take
    cp = ContextParallel(group, partition=partition, chunks_per_rank=2) if size > 1 else None
    mult = size * (2 if partition == "balanced" else 1)
    dt = getattr(torch, dtype)

    def packed_fn() -> PackedSeqs:
        return padded_pack(lengths, pads, mult, 7 * mult)

    T = packed_fn().num_rows
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 32, generator=gen).to(dt)
    g = torch.randn(T, 32, generator=gen).to(dt)
    layers = build_stack(dt, seed, tuple(types), **over)
    if pad_only:
        pad_rows = (~packed_fn().rows(torch.device("cpu")).real).nonzero().flatten().tolist()
        bad = [(pad_rows[r % len(pad_rows)], v) for r, v in bad]
    else:
        bad = [(r % T, v) for r, v in bad]
    return isolation_errors(layers, packed_fn, x, g, bad, cp)
