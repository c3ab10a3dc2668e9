"""``csattn demo --model``: a few training steps of the tiny DeepSeek-V4 model on packed synthetic documents,
once per context-parallel size (CP=1 in this process, CP>1 as spawned gloo processes on CPU), with the loss
curves printed side by side. The curves agree to rounding: CP changes where rows are computed, not what."""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch

from ..cp.launch import free_port, start_ranks
from .checkpoint.safe_state import load_state, save_state
from .config import TrainConfig
from .run import train

__all__ = ["add_model_demo_args", "run_model_demo", "run_spawned"]


def add_model_demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", action="store_true",
                        help="only the model part (same as --only model)")
    parser.add_argument("--model-steps", type=int, default=8, help="training steps per run (with --model)")
    parser.add_argument("--model-seq-len", type=int, default=128, help="rows per packed batch (with --model)")
    parser.add_argument("--model-cp", type=int, nargs="+", default=[1, 2],
                        help="context-parallel sizes to compare (with --model)")


def _worker(rank: int, world: int, port: int, cfg: TrainConfig, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share the CPU cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = train(cfg)
        from ..parallel import full_state_dict

        state = full_state_dict(result.model, result.meshes)  # a collective: every rank gathers
        if rank == 0:
            save_state(out, {"losses": result.losses, "lm_losses": result.lm_losses,
                             "indexer_losses": result.indexer_losses, "state": state})
    finally:
        dist.destroy_process_group()


def run_spawned(world: int, cfg: TrainConfig) -> dict[str, Any]:
    """Run ``train(cfg)`` on ``world`` spawned gloo CPU processes; returns rank 0's losses and final weights."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.safetensors")
        start_ranks(_worker, (world, free_port(), cfg, out), world)
        # a safe format even for our own temp file: the directory is shared, and loading must run no code
        return load_state(out)


def run_model_demo(args: argparse.Namespace) -> int:
    sizes = list(dict.fromkeys(args.model_cp))
    base = dict(steps=args.model_steps, seq_len=args.model_seq_len, device="cpu", seed=args.seed,
                progress=False, warmup_steps=2)
    print(f"tiny DeepSeek-V4 (4 layers W/CSA/HCA/CSA, hash + learned MoE, mHC x4, 1 MTP block), synthetic "
          f"packed documents, {args.model_steps} steps of {args.model_seq_len} rows, fp32 on CPU")
    curves: dict[int, list[float]] = {}
    for cp in sizes:
        cfg = TrainConfig(cp=cp, **base)
        if cp == 1:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                curves[cp] = train(cfg).losses
            finally:
                torch.set_num_threads(threads)
        else:
            curves[cp] = run_spawned(cp, cfg)["losses"]
    head = "".join(f"{'CP=' + str(c):>14}" for c in sizes)
    print(f"{'step':>5}{head}{'max |diff|':>14}")
    worst = 0.0
    for i in range(args.model_steps):
        row = [curves[c][i] for c in sizes]
        diff = max(row) - min(row)
        worst = max(worst, diff)
        print(f"{i + 1:>5}" + "".join(f"{x:>14.6f}" for x in row) + f"{diff:>14.2e}")
    print(f"loss (LM + MTP) {curves[sizes[0]][0]:.4f} -> {curves[sizes[0]][-1]:.4f}; "
          f"largest difference between CP sizes {worst:.2e} (fp32 rounding)")
    return 0
