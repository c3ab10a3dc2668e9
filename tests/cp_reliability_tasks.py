"""Rank work for tests/cp/test_reliability_cp.py: ranks whose metadata caches differ must still run the same
collectives (equal values: same result; different values: the same clear error everywhere)."""

from __future__ import annotations

import torch

from csattn import ContextParallel, PackedSeqs

from .cp_tasks import build_stack

LENGTHS, PADDED = [30, 21, 13], [32, 24, 16]  # 72 rows: 36 per rank at CP = 2, 18 at CP = 4
OTHER = [20, 24, 9]  # same physical layout, different real lengths


def _pack(lengths=LENGTHS, static: bool = False):
    packed = PackedSeqs.from_lengths(list(lengths), padded_lengths=PADDED)
    if not static:
        return packed
    from csattn.capture_safe import CaptureSafePackedSeqs

    return CaptureSafePackedSeqs(packed.cu_seqlens, packed.cu_seqlens_padded, num_rows=packed.num_rows,
                            max_seqlen=max(PADDED))


def _step(layers, x_global, cp, packs) -> list[float]:
    """Forward + backward of the stack with ``packs[i]`` for layer i; per-layer output sums (for comparison)."""
    x = cp.shard(x_global, _pack()).detach().requires_grad_()
    h, sums = x, []
    for layer, packed in zip(layers, packs):
        y = layer(h, packed=packed, cp=cp)
        sums.append(float(y.double().sum()))
        h = h + y
    h.square().sum().backward()
    sums.append(float(x.grad.double().sum()))
    return sums


def cache_mismatch(group, case: str, static: bool = False) -> list[float]:
    """Step 1: every rank runs the CSA + HCA stack with one object per layer (all caches filled). Step 2: rank 0
    keeps its objects and the others pass fresh ones (``case``: ``"reused"``: fresh equal objects;
    ``"second_layer"``: only the second layer's object differs in freshness; ``"differs"``: rank 1 passes
    other values; ``"edited"``: rank 0 edits its object in place to the new values, the others pass fresh
    objects with them). Returns step 2's sums (and step 1's first, to compare)."""
    cp = ContextParallel(group)
    layers = build_stack(torch.float64, 0, ("csa", "hca"))
    x = torch.randn(_pack().num_rows, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    mine = [_pack(static=static), _pack(static=static)]
    first = _step(layers, x, cp, mine)
    rank = cp.rank
    if case == "reused":
        packs = mine if rank == 0 else [_pack(static=static), _pack(static=static)]
    elif case == "second_layer":
        packs = [mine[0], _pack(static=static)] if rank == 0 else [_pack(static=static), mine[1]]
    elif case == "differs":
        packs = mine if rank != 1 else [_pack(OTHER, static), _pack(OTHER, static)]
    elif case == "edited":
        new = _pack(OTHER)
        if rank == 0:
            for p in mine:
                p.cu_seqlens.copy_(new.cu_seqlens)  # in place: same object, same tensor, new values
            packs = mine
        else:
            packs = [_pack(OTHER, static), _pack(OTHER, static)]
    else:
        raise AssertionError(case)
    return first + _step(layers, x, cp, packs)


def fresh_run(group, lengths, static: bool = False) -> list[float]:
    """Step 2's expected sums: the same stack on fresh objects only."""
    cp = ContextParallel(group)
    layers = build_stack(torch.float64, 0, ("csa", "hca"))
    x = torch.randn(_pack().num_rows, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    return _step(layers, x, cp, [_pack(lengths, static), _pack(lengths, static)])


class Largest:
    """Largest tensor (numel) any op creates inside the context (a TorchDispatchMode)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        probe = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        probe.numel = max(probe.numel, t.numel())
                return out

        self.numel = 0
        self.mode = _Mode()

    def __enter__(self) -> Largest:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)


def topk_run(group, topk: int, static: bool = False, lengths=(30, 30)) -> dict:
    """One CSA layer (forward + backward) with ``index_topk = topk``: the largest tensor created, the output,
    the input and parameter grads and the indexer loss. ``group`` None = single process."""
    from csattn.capture_safe import CaptureSafePackedSeqs

    layer = build_stack(torch.float64, 0, ("csa",), index_topk=topk)[0]
    packed = PackedSeqs.from_lengths(list(lengths))
    T = packed.num_rows
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, 32, dtype=torch.float64, generator=gen)
    g = torch.randn(T, 32, dtype=torch.float64, generator=gen)
    cp = ContextParallel(group) if group is not None else None
    if cp is not None:
        x, g = cp.shard(x, packed), cp.shard(g, packed)
    run_packed = CaptureSafePackedSeqs(packed.cu_seqlens, packed.cu_seqlens_padded, num_rows=T,
                                  max_seqlen=max(lengths)) if static else packed
    x = x.requires_grad_()
    with Largest() as probe:
        y = layer(x, packed=run_packed, cp=cp)
        (y * g).sum().backward()
    return {"largest": probe.numel, "out": y.detach(), "dx": x.grad,
            "grads": {n: p.grad for n, p in layer.named_parameters() if p.grad is not None},
            "loss": layer.last_indexer_loss, "max_visible": packed.compress(4).max_visible}
