"""Work run on every rank of a CP test pool: single-process reference vs the context-parallel run."""

from __future__ import annotations

import torch
import torch.distributed as dist

from csattn import AttentionConfig, ContextParallel, HybridAttention, PackedSeqs

TYPES = ("sliding", "csa", "hca")


def tiny_config(layer_type: str, **over) -> AttentionConfig:
    """Window 8, CSA ratio 4, HCA ratio 8: halo 7 rows, so short shards still hold several blocks."""
    kw = dict(
        hidden_size=32, num_heads=2, head_dim=16, rope_head_dim=4, q_lora_rank=16, o_groups=2, o_lora_rank=8,
        sliding_window=8, layer_type=layer_type, compress_ratio={"sliding": 0, "csa": 4, "hca": 8}[layer_type],
        index_n_heads=2, index_head_dim=8, index_topk=3, indexer_loss_coeff=0.3, attn_chunk_rows=24,
        workspace_bytes=4096, rope_theta=10000.0 if layer_type == "sliding" else 160000.0,
        rope_scaling=None if layer_type == "sliding" else AttentionConfig().rope_scaling, backend="reference",
    )
    kw.update(over)
    return AttentionConfig(**kw)


def build_stack(dtype: torch.dtype, seed: int = 0, types=TYPES, **over) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    layers = torch.nn.ModuleList([HybridAttention(tiny_config(t, **over)) for t in types])
    with torch.no_grad():
        for name, p in layers.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    return layers.to(dtype)


def padded_pack(lengths, pads, multiple: int, min_rows: int = 0) -> PackedSeqs:
    """Real ``lengths``, physical ``lengths + pads``, the last document padded up to ``multiple`` rows
    (and to at least ``min_rows``)."""
    phys = [n + p for n, p in zip(lengths, pads)]
    phys[-1] += max(0, min_rows - sum(phys))
    phys[-1] += (-sum(phys)) % multiple
    return PackedSeqs.from_lengths(list(lengths), padded_lengths=phys)


def _run(layers, x, packed, g, cp=None):
    h, outs = x, []
    for layer in layers:
        y = layer(h, packed=packed, cp=cp)
        outs.append(y)
        h = h + y
    (h * g).sum().backward()
    losses = [layer.last_indexer_loss for layer in layers]
    return h, outs, losses


def _rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None and b is None:
        return 0.0
    a = torch.zeros_like(b) if a is None else a
    b = torch.zeros_like(a) if b is None else b
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300)) if b.norm() > 0 else float(a.norm())


def parity(group, lengths, pads=None, partition="contiguous", dtype="float64", seed=0, types=TYPES,
           chunks_per_rank=2, min_rows=None, capture_safe=False, **over) -> dict:
    """Relative errors (CP vs single process) of the stack output, each layer's output, the input grad, every
    parameter grad (summed over ranks) and each indexer loss (summed over ranks). Returns them on rank 0 (the
    other ranks return ``{}``): only rank 0 runs the single-process reference, since its ranks share the CPUs.

    ``capture_safe``: the CP run takes the capture-safe path (a ``CaptureSafePackedSeqs`` of the same pack), and a
    second forward + backward under ``NoHostSync`` must not read a device value on the host."""
    dt = getattr(torch, dtype)
    cp = ContextParallel(group, partition=partition, chunks_per_rank=chunks_per_rank)
    size = cp.size
    pads = pads or [0] * len(lengths)
    mult = size * (chunks_per_rank if partition == "balanced" else 1)
    min_rows = 7 * mult if min_rows is None else min_rows  # every chunk at least the 7-row halo
    packed = padded_pack(lengths, pads, mult, min_rows)
    T = packed.num_rows
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, 32, generator=gen).to(dt)
    g = torch.randn(T, 32, generator=gen).to(dt)

    lead = dist.get_rank(group) == 0
    if lead:
        ref_layers = build_stack(dt, seed, types, **over)
        xr = x.clone().requires_grad_()
        ref_out, ref_outs, ref_losses = _run(ref_layers, xr, packed, g)

    layers = build_stack(dt, seed, types, **over)
    packed_cp = padded_pack(lengths, pads, mult, min_rows)  # a fresh object: nothing cached from the reference run
    xl = cp.shard(x, packed_cp).requires_grad_()
    packed_run = packed_cp
    if capture_safe:
        from csattn.capture_safe import CaptureSafePackedSeqs, NoHostSync

        phys = (packed_cp.cu_seqlens_padded[1:] - packed_cp.cu_seqlens_padded[:-1]).max().item()
        packed_run = CaptureSafePackedSeqs(packed_cp.cu_seqlens, packed_cp.cu_seqlens_padded, num_rows=T,
                                      max_seqlen=int(phys))
    out_l, outs_l, losses_l = _run(layers, xl, packed_run, cp.shard(g, packed_cp), cp)
    if capture_safe:  # the agreement check ran on the first call; now nothing may read the device
        xl2 = xl.detach().clone().requires_grad_()
        again, g_local = build_stack(dt, seed, types, **over), cp.shard(g, packed_cp)
        with NoHostSync():
            _run(again, xl2, packed_run, g_local, cp)

    grads = []
    for name, p in layers.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        flag = torch.tensor([0.0 if p.grad is None else 1.0], dtype=torch.float64)
        dist.all_reduce(grad, group=group)
        dist.all_reduce(flag, group=group)
        grads.append((name, grad if flag.item() > 0 else None))
    losses = [None if ll is None else ll.detach().clone() for ll in losses_l]
    for tot in losses:  # every rank alike: whether a layer has a loss depends on its type alone
        if tot is not None:
            dist.all_reduce(tot, group=group)
    got = _named(cp.gather(out_l.detach(), packed_cp), [cp.gather(y.detach(), packed_cp) for y in outs_l],
                 cp.gather(xl.grad, packed_cp), grads, losses)
    # fewest compressed groups any rank owned in any compressed layer (0 = a rank owned none)
    owned = [v[1].num_owned for k, v in packed_cp._cache.items() if k[0] == "cp-plan" and v[0].entries is not None]
    least = torch.tensor([min(owned) if owned else -1])
    dist.all_reduce(least, op=dist.ReduceOp.MIN, group=group)
    if not lead:
        return {}
    ref = _named(ref_out, ref_outs, xr.grad, [(n, p.grad) for n, p in ref_layers.named_parameters()], ref_losses)
    assert got.keys() == ref.keys(), f"CP and the reference differ in what they produce: {got.keys() ^ ref.keys()}"
    err = {key: _rel(got[key], ref[key]) for key in ref}
    err["_min_owned"] = int(least)
    return err


def _named(out, outs, dx, grads, losses) -> dict:
    """``parity``'s results by name: the stack output, each layer's output, the input grad, each parameter's grad
    (``grads``: (name, grad or None) pairs) and each indexer loss a layer has."""
    named = {"out": out, "dx": dx, **{f"out{i}": y for i, y in enumerate(outs)}}
    named.update({f"grad:{name}": g for name, g in grads})
    named.update({f"loss{i}": loss for i, loss in enumerate(losses) if loss is not None})
    return named


def memory_probe(group, num_rows: int) -> dict:
    """Largest floating tensor created during a CP forward + backward of the W/CSA/HCA stack on one long
    document, and the bound ``(ext rows + global compressed entries) * widest per-row width``."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel, self.shape, self.op = 0, None, None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > self.numel:
                    self.numel, self.shape, self.op = t.numel(), tuple(t.shape), str(func)
            return out

    cp = ContextParallel(group)
    packed = PackedSeqs.from_lengths([num_rows])
    chunk = 4  # sparse attention gathers [chunk rows, W + visible entries, d] per step (HCA: all T / r entries)
    layers = build_stack(torch.float64, 0, attn_chunk_rows=chunk)
    x = cp.shard(torch.randn(num_rows, 32, dtype=torch.float64), packed).requires_grad_()
    with Largest() as probe:
        h = x
        for layer in layers:
            h = h + layer(h, packed=packed, cp=cp)
        h.square().sum().backward()
    cfg = layers[1].config
    local = num_rows // cp.size
    ext = local + 2 * 7  # at most two halos of 7 rows (one segment per rank in the contiguous layout)
    width = max(cfg.num_heads * cfg.head_dim, cfg.hidden_size, 2 * cfg.head_dim, cfg.q_lora_rank,
                cfg.index_n_heads * cfg.index_head_dim)
    hca = layers[2].config
    attn_chunk = chunk * (hca.sliding_window + num_rows // hca.compress_ratio) * hca.head_dim
    bound = max((ext + num_rows // cfg.compress_ratio) * width, attn_chunk)
    return {"numel": probe.numel, "shape": probe.shape, "op": probe.op, "bound": bound, "global": num_rows * width}


def bad_input(group, case: str) -> None:
    """Each case must raise the same ValueError on every rank."""
    cp = ContextParallel(group)
    layer = build_stack(torch.float64, 0, ("csa",))[0]
    rank, size = cp.rank, cp.size
    if case == "short_shard":
        packed = PackedSeqs.from_lengths([4 * size])  # 4 rows per rank < halo 7
        x = torch.randn(4, 32, dtype=torch.float64)
    elif case == "not_divisible":
        packed = PackedSeqs.from_lengths([64 * size + 1])
        x = torch.randn(64 + (1 if rank == 0 else 0), 32, dtype=torch.float64)
    elif case == "mismatched":
        lengths = [40, 24 * size - 40] if rank == 0 else [24 * size - 40, 40]
        packed = PackedSeqs.from_lengths(lengths)
        x = torch.randn(24, 32, dtype=torch.float64)
    elif case == "wrong_rows":
        packed = PackedSeqs.from_lengths([32 * size])
        x = torch.randn(32 if rank else 33, 32, dtype=torch.float64)
    else:
        raise AssertionError(case)
    out = layer(x.requires_grad_(), packed=packed, cp=cp)
    out.sum().backward()


def saved_input_copies(group, num_rows: int, partition: str) -> list[tuple]:
    """Shapes of the ``D``-wide tensors with more than a halo's rows that a CP forward saves for the backward
    and that are not views of the rank's own input, and of saved halo-sized views into a larger buffer (W, CSA
    and HCA layers); a rank should save none: its halo-extended rows are projected piece by piece instead of
    being copied into one tensor, and its halo rows are copied out of the gathered tails."""
    cp = ContextParallel(group, partition=partition)
    packed = PackedSeqs.from_lengths([num_rows // 3, num_rows - num_rows // 3])
    copies = []
    for layer in build_stack(torch.float64, 0):
        x = cp.shard(torch.randn(num_rows, 32, dtype=torch.float64), packed).requires_grad_()
        own = {x.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in layer.parameters()}

        def pack(t, own=own, kind=layer.config.layer_type):
            if t.dim() == 2 and t.shape[1] == 32 and t.untyped_storage().data_ptr() not in own:
                if t.shape[0] > 16:
                    copies.append((kind, tuple(t.shape)))
                elif t.untyped_storage().nbytes() > t.numel() * t.element_size():
                    # a halo view into the gathered tails would keep every rank's tails alive
                    copies.append((kind, tuple(t.shape), "view of", t.untyped_storage().nbytes() // t.element_size()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(x, packed=packed, cp=cp)
        y.square().sum().backward()
    return copies


def capture_safe_rejects(group, partition: str) -> None:
    """The capture-safe CP path must raise the same ValueError on every rank (here: the balanced partition)."""
    from csattn.capture_safe import CaptureSafePackedSeqs

    cp = ContextParallel(group, partition=partition)
    layer = build_stack(torch.float64, 0, ("csa",))[0]
    packed = PackedSeqs.from_lengths([40 * cp.size])
    static = CaptureSafePackedSeqs(packed.cu_seqlens, packed.cu_seqlens_padded, num_rows=40 * cp.size,
                              max_seqlen=40 * cp.size)
    x = torch.randn(40, 32, dtype=torch.float64, requires_grad=True)
    layer(x, packed=static, cp=cp).sum().backward()
