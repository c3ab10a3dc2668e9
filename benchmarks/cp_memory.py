"""Per-rank peak memory of one attention layer's forward + backward under context parallelism.

For every stream length T and CP size P, P ranks (gloo, all on one GPU: NCCL refuses two ranks per GPU)
run one layer with the real V4-Flash geometry (H=64, d=512, k=512, W=128, D=4096, indexer 64 x 128) on a
single T-token document, sharded with ``ContextParallel``. Each rank reports
``torch.cuda.max_memory_allocated`` during forward + backward minus what was allocated before (weights,
their pre-allocated grads, the input shard): its activation memory. One persistent pool of ranks serves
all configurations; a configuration that fails (e.g. out of memory) restarts the pool.

    python benchmarks/cp_memory.py --sizes 8192 16384 32768 --cp 1 2 4 --json out.json

On a machine without CUDA it runs on CPU (timing only; use small ``--sizes`` and ``--small``).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
import traceback
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(layer_type: str, backend: str, small: bool, chunk_rows: int, workspace: int):
    from csattn import AttentionConfig

    geo = dict(hidden_size=4096, num_heads=64, head_dim=512, rope_head_dim=64, q_lora_rank=1024, o_groups=8,
               o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128)
    if small:
        geo = dict(hidden_size=64, num_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=32, o_groups=2,
                   o_lora_rank=16, index_n_heads=4, index_head_dim=16, index_topk=16, sliding_window=16)
    ratio = {"csa": 4, "hca": 128, "sliding": 0}[layer_type]
    return AttentionConfig(layer_type=layer_type, compress_ratio=ratio, indexer_loss_coeff=0.01, backend=backend,
                           attn_chunk_rows=chunk_rows, workspace_bytes=workspace, **geo)


def _measure(group, task: dict) -> dict:
    import torch.distributed as dist

    from csattn import ContextParallel, HybridAttention, PackedSeqs

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = _config(task["layer"], task["backend"], task["small"], task["chunk_rows"], task["workspace"])
    torch.manual_seed(0)
    layer = HybridAttention(cfg).to(device=device, dtype=dtype)
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    cp = ContextParallel(group, partition=task["partition"])
    T = task["tokens"]
    packed = PackedSeqs.from_lengths([T], device=device)
    local = T // cp.size
    # The same global input at every CP size, yet never a [T, D] tensor on a rank: rows are drawn in
    # 16-row blocks, each from its own seed.
    block = 16

    def rows_of(seed: int, width: int) -> torch.Tensor:
        parts = []
        for a, b in cp.layout(packed).segments(cp.rank):
            for lo in range(a, b, block):
                gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + lo // block)
                parts.append(torch.randn(min(block, b - lo), width, device=device, generator=gen))
        return torch.cat(parts).to(dtype)

    x = rows_of(1, cfg.hidden_size).requires_grad_()
    grad_out = rows_of(2, cfg.hidden_size)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    out = layer(x, packed=packed, cp=cp)
    out.backward(grad_out)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    res = {"seconds": seconds, "rows": local}
    if cuda:
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        res["act_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        res["base_gib"] = base / 2**30
    sq = out.detach().float().pow(2).sum()
    dist.all_reduce(sq, group=group)
    res["out_sq"] = float(sq)
    loss = layer.last_indexer_loss
    if loss is not None:
        tot = loss.detach().float().clone()
        dist.all_reduce(tot, group=group)
        res["indexer_loss"] = float(tot)
    del out, x, grad_out, layer
    if cuda:
        torch.cuda.empty_cache()
    return res


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    groups = {p: dist.new_group(list(range(p))) for p in range(1, world + 1)}
    while True:
        task = tasks.get()
        if task is None:
            break
        size = task["cp"]
        if rank >= size:
            results.put((rank, "idle", None))
            continue
        try:
            results.put((rank, "ok", _measure(groups[size], task)))
        except Exception as err:
            oom = "out of memory" in str(err).lower()
            results.put((rank, "oom" if oom else "error", f"{type(err).__name__}: {str(err)[:300]}"
                         + ("" if oom else "\n" + traceback.format_exc()[-1500:])))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


class _Pool:
    def __init__(self, world: int) -> None:
        from csattn.cp.launch import free_port, process, rank_context

        ctx = rank_context()
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [process(_worker, r, world, port, self.tasks[r], self.results, daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, task: dict, timeout: float) -> list:
        for q in self.tasks:
            q.put(task)
        out = [None] * self.world
        for _ in range(self.world):
            rank, status, value = self.results.get(timeout=timeout)
            out[rank] = (status, value)
        return out[: task["cp"]]

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
        self.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layer", default="csa", choices=["csa", "hca", "sliding"])
    ap.add_argument("--backends", nargs="+", default=["reference"])
    ap.add_argument("--partition", default="contiguous", choices=["contiguous", "balanced"])
    ap.add_argument("--chunk-rows", type=int, default=256, help="reference sparse-attention rows per chunk")
    ap.add_argument("--workspace-mib", type=int, default=128, help="indexer / loss workspace bound (MiB)")
    ap.add_argument("--small", action="store_true", help="tiny geometry (CPU smoke runs)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new configurations after this")
    ap.add_argument("--timeout-s", type=float, default=150.0, help="per configuration")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    start = time.time()
    world = max(args.cp)
    pool = _Pool(world)
    rows = []
    try:
        skip_from: dict[tuple[str, int], int] = {}  # (backend, cp) -> first size that failed
        for tokens in args.sizes:
            for backend in args.backends:
                for size in args.cp:
                    if time.time() - start > args.budget_s:
                        print(f"budget reached, skipping T={tokens} CP={size} {backend}", flush=True)
                        continue
                    if (backend, size) in skip_from and tokens > skip_from[(backend, size)]:
                        rows.append({"backend": backend, "tokens": tokens, "cp": size, "status": "skipped"})
                        continue
                    task = {"tokens": tokens, "cp": size, "layer": args.layer, "backend": backend,
                            "partition": args.partition, "small": args.small, "chunk_rows": args.chunk_rows,
                            "workspace": args.workspace_mib << 20}
                    try:
                        res = pool.run(task, args.timeout_s)
                    except queue.Empty:
                        res = [("timeout", None)]
                    statuses = {s for s, _ in res}
                    row = {"backend": backend, "tokens": tokens, "cp": size, "layer": args.layer,
                           "partition": args.partition}
                    if statuses == {"ok"}:
                        vals = [v for _, v in res]
                        row.update(status="ok", per_rank=vals,
                                   act_gib_max=max(v.get("act_gib", 0.0) for v in vals),
                                   peak_gib_max=max(v.get("peak_gib", 0.0) for v in vals),
                                   seconds_max=max(v["seconds"] for v in vals), out_sq=vals[0]["out_sq"],
                                   indexer_loss=vals[0].get("indexer_loss"))
                    else:
                        row.update(status="oom" if "oom" in statuses else "failed",
                                   detail=[v for s, v in res if s != "ok"][:1])
                        skip_from[(backend, size)] = tokens
                        pool.kill()
                        pool = _Pool(world)
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "per_rank"}), flush=True)
    finally:
        pool.close()
    # CP1 / CPn ratios of per-rank activation memory
    by = {(r["backend"], r["tokens"], r["cp"]): r for r in rows if r.get("status") == "ok"}
    for r in rows:
        one = by.get((r["backend"], r["tokens"], 1))
        if r.get("status") == "ok" and one and r.get("act_gib_max"):
            r["ratio_vs_cp1"] = one["act_gib_max"] / r["act_gib_max"]
    print("\n| backend | tokens | CP | per-rank act. GiB (max) | per-rank peak GiB | fwd+bwd s | CP1/CPn |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("status") != "ok":
            print(f"| {r['backend']} | {r['tokens']} | {r['cp']} | {r['status']} | | | |")
            continue
        ratio = f"{r['ratio_vs_cp1']:.2f}x" if "ratio_vs_cp1" in r else ""
        print(f"| {r['backend']} | {r['tokens']} | {r['cp']} | {r['act_gib_max']:.2f} | {r['peak_gib_max']:.2f} "
              f"| {r['seconds_max']:.2f} | {ratio} |")
    if args.json:
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        meta = {"torch": torch.__version__, "commit": os.environ.get("CSATTN_COMMIT", "unknown"),
                "device": device, "args": vars(args), "wall_s": time.time() - start}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
