"""What one layer's forward keeps alive for its backward, tensor by tensor, at CP = 1 or on one CP rank.

The scaling report measures activation memory as one number (allocated after the forward minus before it);
this lists what makes it up: every storage created during the forward that is still alive after it (saved
for the backward, held by an autograd function, or the output), with its shape, dtype and the op that made
it, largest first. Parameters and the input are left out. Comparing CP = 1 with one rank of CP = P shows what
a rank keeps beyond ``1 / P`` of the single-process activations. The accounting is
:mod:`csattn.report.live_tensors`; this is its command.

Examples (on the GPU machine; several gloo ranks share one GPU, or NCCL with one GPU per rank):
    python -m benchmarks.live_tensors --layer csa --tokens 32768 --cp 1
    python -m benchmarks.live_tensors --layer csa --tokens 32768 --cp 4 --partition balanced
CPU (reference backend, float32, a few thousand tokens):
    python -m benchmarks.live_tensors --layer csa --tokens 2048 --cp 4 --device cpu --dtype float32
The whole model (the 4-layer V4-Flash proxy), per component, KiB per token per layer:
    python -m benchmarks.live_tensors --model --tokens 16384 --recompute none
with ``--json``, the per-component bytes and the run's ``meta`` (commit, versions) as JSON (the planner's
``KEPT_KIB`` is derived from ``benchmarks/results/h200/model_kept.json``).
"""

from __future__ import annotations

import argparse
import gc
import os
from collections import defaultdict

import torch
import torch.distributed as dist

from csattn.report.live_tensors import LiveStorages, model_kept


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


def _run_model(args: argparse.Namespace) -> None:
    """What one training forward of the model proxy keeps, per component and per token per layer."""
    import json

    from csattn.report.model import proxy_model

    from .providers.model import DEFAULTS, _batch, proxy_config
    from .run import run_meta

    device = torch.device(args.device)
    shape = {**DEFAULTS, "tokens": args.tokens, "experts": args.experts, "topk_experts": args.topk_experts,
             "layers": args.layers, "recompute": args.recompute}
    cfg = proxy_config(shape, "auto")
    model = proxy_model(cfg, getattr(torch, args.dtype), device)
    lengths, ids, packed, labels = _batch(shape, cfg.vocab_size, device)

    def step():
        return model(ids, packed=packed, labels=labels, return_logits=False).loss

    step().backward()  # warm-up: caches, compiled kernels
    model.zero_grad(set_to_none=True)
    kept, loss = model_kept(model, step)
    T, n = sum(lengths), cfg.num_hidden_layers
    total = sum(kept.values())
    print(f"# model proxy, {n} layers, {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, recompute "
          f"{cfg.recompute}, {T} tokens, {args.dtype} on {device.type}: kept for the backward {total / 2**30:.2f} GiB"
          f" = {total / T / n / 1024:.1f} KiB per token per layer")
    for name, nb in sorted(kept.items(), key=lambda kv: -kv[1])[: args.rows]:
        print(f"{nb / 2**20:12.1f} MiB  {nb / T / 1024:8.2f} KiB/token  {name or '(outside any module)'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": run_meta(device, args.commit), "tokens": T, "layers": n, "recompute": cfg.recompute,
                       "experts": cfg.n_routed_experts, "topk": cfg.num_experts_per_tok, "dtype": args.dtype,
                       "total_bytes": total, "kib_per_token_per_layer": total / T / n / 1024,
                       "by_component": kept}, f, indent=1)
    loss.backward()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="store_true",
                   help="the whole DeepSeek-V4 proxy (benchmarks/configs/v4_flash_proxy.json) instead of one layer")
    p.add_argument("--experts", type=int, default=8, help="with --model: routed experts")
    p.add_argument("--topk-experts", type=int, default=2, help="with --model: experts per token")
    p.add_argument("--layers", type=int, default=4, help="with --model: decoder layers")
    p.add_argument("--recompute", default="none", choices=["none", "mhc", "moe", "block"], help="with --model")
    p.add_argument("--json", default=None, help="with --model: write the per-component bytes here")
    p.add_argument("--commit", default=None, help="with --json: the recorded commit (default: git rev-parse)")
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
    if args.model:
        _run_model(args)
        return
    if args.cp == 1:
        _run(0, 1, 0, args)
        return
    from csattn.cp.launch import free_port, start_ranks

    os.environ.setdefault("OMP_NUM_THREADS", "4")
    start_ranks(_run, (args.cp, free_port(), args), args.cp)


if __name__ == "__main__":
    main()
