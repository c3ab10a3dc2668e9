"""The main job's first part on a small default: a W / CSA / HCA stack on a packed batch of ragged documents.

Prints per-layer output statistics, the indexer loss, and the largest difference between the packed run
and running each document alone (which must be rounding only).
"""

from __future__ import annotations

import argparse

import torch

from ..config import AttentionConfig
from ..layers import HybridAttention
from ..layers.plan import ContextParallelGroup
from ..packing import PackedSeqs

__all__ = ["demo_config", "build_demo_stack", "demo_batch", "run_stack", "run_stack_demo", "add_demo_args"]


def demo_config(layer_type: str) -> AttentionConfig:
    """A small geometry that still exercises every path: windows, blocks, top-k < visible entries."""
    return AttentionConfig(
        hidden_size=64, num_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=32, o_groups=2,
        o_lora_rank=16, sliding_window=16, layer_type=layer_type,
        compress_ratio={"sliding": 0, "csa": 4, "hca": 16}[layer_type],
        index_n_heads=4, index_head_dim=16, index_topk=6,
        rope_theta=10000.0 if layer_type == "sliding" else 160000.0,
        rope_scaling=None if layer_type == "sliding" else AttentionConfig().rope_scaling,
        indexer_loss_coeff=0.01,
    )


def build_demo_stack(dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.ModuleList:
    """Three layers, W then CSA then HCA, with random (non-zero) sinks and position biases."""
    torch.manual_seed(seed)
    layers = torch.nn.ModuleList([HybridAttention(demo_config(t)) for t in ("sliding", "csa", "hca")])
    with torch.no_grad():
        for name, p in layers.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.normal_(0, 0.5)
    return layers.to(dtype)


def demo_batch(lengths: list[int], hidden: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(lengths), hidden, generator=g).to(dtype)


def run_stack(layers, x: torch.Tensor, packed: PackedSeqs,
              cp: ContextParallelGroup | None = None) -> tuple[torch.Tensor, list]:
    """Residual stack ``x + attn(x)``; returns the output and the per-layer outputs."""
    outs = []
    h = x
    for layer in layers:
        y = layer(h, packed=packed, cp=cp)
        outs.append(y)
        h = h + y
    return h, outs


def _document_length(text: str) -> int:
    """argparse type of ``--lengths``: the demo prints per-document statistics, so every document has a token."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a document length must be an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"every document length must be >= 1, got {n} (drop it from --lengths)")
    return n


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=_document_length, nargs="+", default=[5, 37, 1, 64, 19, 100, 3, 40],
                        help="document lengths of the packed batch (each >= 1)")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cp", type=int, default=1,
                        help="also run the stack with context parallelism over N gloo ranks and print its parity")
    parser.add_argument("--cp-partition", choices=["contiguous", "balanced"], default="contiguous")


def run_stack_demo(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype)
    layers = build_demo_stack(dtype, args.seed)
    lengths = list(args.lengths)
    packed = PackedSeqs.from_lengths(lengths)
    x = demo_batch(lengths, layers[0].config.hidden_size, dtype).requires_grad_()
    out, per_layer = run_stack(layers, x, packed)
    out.square().mean().backward()

    print(f"packed batch: {len(lengths)} documents, {sum(lengths)} tokens, lengths {lengths}, {args.dtype}")
    print(f"{'layer':<8}{'type':<9}{'mean':>12}{'std':>12}{'max|y|':>12}{'indexer loss':>15}")
    for i, (layer, y) in enumerate(zip(layers, per_layer)):
        loss = layer.last_indexer_loss
        loss_s = f"{float(loss):.6f}" if loss is not None else "-"
        print(f"{i:<8}{layer.config.layer_type:<9}{float(y.detach().mean()):>12.5f}{float(y.detach().std()):>12.5f}"
              f"{float(y.detach().abs().max()):>12.5f}{loss_s:>15}")

    # each document alone
    worst = 0.0
    start = 0
    with torch.no_grad():
        for n in lengths:
            alone, _ = run_stack(layers, x[start:start + n].detach(), PackedSeqs.from_lengths([n]))
            ref = out[start:start + n].detach()
            worst = max(worst, float((alone - ref).abs().max()))
            start += n
    print(f"max |packed - per-document| over the stack output: {worst:.3e}")
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    if worst > tol:
        print(f"FAILED: packed and per-document runs differ by more than {tol:g}")
        return 1
    print("packed run matches per-document runs")
    return 0

