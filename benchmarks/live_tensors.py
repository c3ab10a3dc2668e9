"""What one layer's forward keeps alive for its backward, tensor by tensor, at CP = 1 or on one CP rank.

The scaling report measures activation memory as one number (allocated after the forward minus before it);
this lists what makes it up: every storage created during the forward that is still alive after it (saved
for the backward, held by an autograd function, or the output), with its shape, dtype and the op that made
it, largest first. Parameters and the input are left out. Comparing CP = 1 with one rank of CP = P shows what
a rank keeps beyond ``1 / P`` of the single-process activations.

Examples (on the GPU machine; several gloo ranks share one GPU, or NCCL with one GPU per rank):
    python -m benchmarks.live_tensors --layer csa --tokens 32768 --cp 1
    python -m benchmarks.live_tensors --layer csa --tokens 32768 --cp 4 --partition balanced
CPU (reference backend, float32, a few thousand tokens):
    python -m benchmarks.live_tensors --layer csa --tokens 2048 --cp 4 --device cpu --dtype float32
"""

from __future__ import annotations

import argparse
import gc
import os
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveStorages(TorchDispatchMode):
    """Records every storage an op outputs (weakly), so the ones still alive later can be listed.

    With ``track_peak``, after every op it also sums the bytes of the recorded storages still alive (leaving out
    the storages in ``exclude``) and keeps the list of them at the largest sum seen: what is alive at the peak of
    a forward + backward, tensor by tensor, on any device.
    """

    def __init__(self, track_peak: bool = False, exclude: set[int] | None = None) -> None:
        super().__init__()
        self.made: dict[int, tuple] = {}
        self.track_peak = track_peak
        self.exclude = exclude or set()
        self.peak_bytes = 0
        self.peak_rows: list[tuple[int, tuple, str, str]] = []
        self.peak_op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                old = self.made.get(s.data_ptr())
                # an address freed earlier in the forward can be handed out again: the newest storage wins
                if s.nbytes() > 0 and (old is None or old[0]() is None):
                    self.made[s.data_ptr()] = (weakref.ref(s), tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                               s.nbytes(), str(func).removeprefix("aten."))
        if self.track_peak:
            self.made = {ptr: v for ptr, v in self.made.items() if v[0]() is not None}
            total = sum(v[3] for ptr, v in self.made.items() if ptr not in self.exclude)
            if total > self.peak_bytes:
                self.peak_bytes, self.peak_op = total, str(func).removeprefix("aten.")
                self.peak_rows = self.alive(self.exclude)
        return out

    def alive(self, exclude: set[int]) -> list[tuple[int, tuple, str, str]]:
        """``(bytes, shape, dtype, op)`` of the recorded storages still alive, largest first."""
        rows = [(nb, shape, dt, op) for ptr, (ref, shape, dt, nb, op) in self.made.items()
                if ptr not in exclude and ref() is not None]
        return sorted(rows, key=lambda r: -r[0])


def print_rows(rows: list[tuple[int, tuple, str, str]], limit: int) -> None:
    """The rows grouped by shape, dtype and op, largest group first."""
    grouped: dict[tuple, list[int]] = defaultdict(list)
    for nb, shape, dt, op in rows:
        grouped[(shape, dt, op)].append(nb)
    for (shape, dt, op), sizes in sorted(grouped.items(), key=lambda kv: -sum(kv[1]))[:limit]:
        print(f"{sum(sizes) / 2**20:10.3f} MiB  {len(sizes):3d} x {str(list(shape)):<22} {dt:<9} {op}")


def _run(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    from csattn import ContextParallel
    from csattn.report.worker import Job, build_case, init_rank

    device = init_rank(rank, world, port, args.device)
    path = args.path or ("triton" if device.type == "cuda" else "reference")
    cp = ContextParallel(None, partition=args.partition) if world > 1 else None
    job = Job(args.layer, args.tokens, path, args.partition)
    _, layer, packed, x_local, _ = build_case(job, {"dtype": args.dtype, "geometry": args.geometry}, device, cp)
    layer(x_local, packed=packed, cp=cp).float().sum().backward()  # warm-up: caches, compiled kernels
    for p in layer.parameters():
        p.grad = None
    x_local.grad = None
    gc.collect()
    own = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x_local.untyped_storage().data_ptr()}
    head = (f"# {args.layer} {args.tokens} tokens, CP {world} {args.partition if world > 1 else ''}, rank 0 of "
            f"{world}: {x_local.shape[0]} rows, path {path}, {args.dtype} on {device.type}")
    if args.peak:
        dy = torch.randn_like(x_local)
        own.add(dy.untyped_storage().data_ptr())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        with LiveStorages(track_peak=True, exclude=own) as live:
            y = layer(x_local, packed=packed, cp=cp)
            y.backward(dy)
        if rank == 0:
            print(head)
            print(f"# peak of forward + backward: {live.peak_bytes / 2**20:.2f} MiB alive after {live.peak_op}"
                  + (f" (allocator peak above the start: {(torch.cuda.max_memory_allocated(device) - base) / 2**20:.2f}"
                     " MiB)" if device.type == "cuda" else ""))
            print_rows(live.peak_rows, args.rows)
    else:
        gc.collect()
        with LiveStorages() as live:
            y = layer(x_local, packed=packed, cp=cp)
        gc.collect()
        rows = live.alive(own)
        if rank == 0:
            total = sum(r[0] for r in rows)
            print(head)
            print(f"# alive after the forward: {total / 2**20:.2f} MiB in {len(rows)} storages "
                  f"({total / 2**20 * world:.2f} MiB x CP size)")
            print_rows(rows, args.rows)
    del y
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", default="csa", choices=["csa", "hca"])
    p.add_argument("--tokens", type=int, default=32768, help="packed tokens (ragged documents, as in the report)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (rank 0 is listed)")
    p.add_argument("--partition", default="contiguous", choices=["contiguous", "balanced"])
    p.add_argument("--path", default=None, choices=["triton", "reference", "unfused"],
                   help="default: triton on CUDA, reference on the CPU")
    p.add_argument("--geometry", default="real", choices=["real", "tiny"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=30, help="rows of the table (grouped by shape, dtype and op)")
    p.add_argument("--peak", action="store_true",
                   help="list what is alive at the peak of forward + backward instead of after the forward")
    args = p.parse_args()
    if args.cp == 1:
        _run(0, 1, 0, args)
        return
    from csattn.report.run import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "4")
    mp.spawn(_run, args=(args.cp, free_port(), args), nprocs=args.cp)


if __name__ == "__main__":
    main()
