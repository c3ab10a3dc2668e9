"""``csattn demo --cp N``: the demo stack at CP=1 and CP=N on the same packed batch (gloo ranks on CPU).

Every rank runs the single-process stack itself (the reference), then the context-parallel stack on its
rows; rank 0 prints the parity table (stack output, input grad, every parameter grad summed over ranks,
indexer losses summed over ranks) and each rank's activation memory at CP=1 and CP=N.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ..cp.launch import free_port, rank_context, start_ranks

__all__ = ["run_cp_demo", "SavedActivations"]


class SavedActivations:
    """Bytes of the distinct storages autograd saves for backward while active, parameters excluded: a
    device-independent measure of activation memory."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.storages: dict[int, int] = {}
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def _pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in self.params:
            self.storages[st.data_ptr()] = st.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def mib(self) -> float:
        return sum(self.storages.values()) / 2**20


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float(a.norm())


def _worker(rank: int, size: int, port: int, args: argparse.Namespace, failed) -> None:
    from ..cp import ContextParallel
    from ..packing import PackedSeqs
    from .stack import build_demo_stack, demo_batch, run_stack

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=120))
    dtype = getattr(torch, args.dtype)
    lengths = list(args.lengths)
    cp = ContextParallel(None, partition=args.cp_partition)
    chunks = size * (cp.chunks_per_rank if args.cp_partition == "balanced" else 1)
    # pad the last document so the stream splits into equal chunks of at least one halo (16 rows)
    phys = list(lengths)
    phys[-1] += max(0, 16 * chunks - sum(phys))
    phys[-1] += (-sum(phys)) % chunks
    packed = PackedSeqs.from_lengths(lengths, padded_lengths=phys)
    T = packed.num_rows

    ref = build_demo_stack(dtype, args.seed)
    hidden = ref[0].config.hidden_size
    x = demo_batch(phys, hidden, dtype)
    weight = packed.rows().real.to(dtype)[:, None] / (packed.rows().num_real * hidden)
    xr = x.clone().requires_grad_()
    with SavedActivations(ref) as mem1:
        out1, _ = run_stack(ref, xr, packed)
    (out1.square() * weight).sum().backward()
    losses1 = [layer.last_indexer_loss for layer in ref]

    layers = build_demo_stack(dtype, args.seed)
    packed_cp = PackedSeqs.from_lengths(lengths, padded_lengths=phys)
    xl = cp.shard(x, packed_cp).requires_grad_()
    with SavedActivations(layers) as memn:
        outn, _ = run_stack(layers, xl, packed_cp, cp=cp)
    (outn.square() * cp.shard(weight, packed_cp)).sum().backward()

    rows = [("stack output", _rel(cp.gather(outn.detach(), packed_cp), out1)),
            ("input grad", _rel(cp.gather(xl.grad, packed_cp), xr.grad))]
    for (name, p), (_, pr) in zip(layers.named_parameters(), ref.named_parameters()):
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g)
        rows.append((f"grad {name}", _rel(g, torch.zeros_like(p) if pr.grad is None else pr.grad)))
    for i, (layer, l1) in enumerate(zip(layers, losses1)):
        if l1 is None:
            continue
        tot = layer.last_indexer_loss.detach().clone()
        dist.all_reduce(tot)
        rows.append((f"indexer loss (layer {i})", _rel(tot, l1)))
    mem = torch.tensor([mem1.mib, memn.mib], dtype=torch.float64)
    mems = [torch.zeros_like(mem) for _ in range(size)]
    dist.all_gather(mems, mem)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    worst = max(err for _, err in rows)
    if rank == 0:
        print(f"\ncontext parallelism: CP=1 vs CP={size} ({args.cp_partition} partition, gloo), {T} rows "
              f"({T - sum(lengths)} padding), {args.dtype}")
        print(f"{'tensor':<52}{'rel. error':>12}")
        for name, err in rows:
            print(f"{name:<52}{err:>12.2e}{'' if err <= tol else '  FAILED'}")
        print(f"per-rank saved activations (MiB): CP=1 {mems[0][0]:.3f}; CP={size} "
              + ", ".join(f"rank {r} {m[1]:.3f}" for r, m in enumerate(mems)))
        print(f"CP={size} matches CP=1 within {tol:g}" if worst <= tol else
              f"FAILED: CP={size} differs from CP=1 by {worst:.2e} > {tol:g}")
    dist.destroy_process_group()
    if worst > tol:
        failed.value = 1


def run_cp_demo(args: argparse.Namespace) -> int:
    """Spawn ``args.cp`` gloo ranks on this machine and run the CP parity demo. Returns 0 when it matches."""
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    failed = rank_context().Value("i", 0)
    start_ranks(_worker, (args.cp, port, args, failed), args.cp)
    return int(failed.value)
