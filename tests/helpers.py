"""Small shared helpers for the tests."""

from __future__ import annotations

import torch

from csattn import AttentionConfig, HybridAttention


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / max(||b||, tiny)`` in fp64: the tests' one relative-error measure."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tiny_config(layer_type: str, **overrides) -> AttentionConfig:
    base = dict(
        hidden_size=32, num_heads=2, head_dim=16, rope_head_dim=8, q_lora_rank=16, o_groups=2,
        o_lora_rank=8, sliding_window=6, layer_type=layer_type,
        compress_ratio={"sliding": 0, "csa": 4, "hca": 8}[layer_type],
        index_n_heads=8, index_head_dim=8, index_topk=3, indexer_loss_coeff=0.5,
    )
    base.update(overrides)
    return AttentionConfig(**base)


def random_layer(cfg: AttentionConfig, dtype=torch.float64, seed: int = 0) -> HybridAttention:
    torch.manual_seed(seed)
    layer = HybridAttention(cfg).to(dtype)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("sinks", "position_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return layer


def layer_step(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, packed=None,
               run=None, indexer_loss_scale: float | torch.Tensor = 1.0
               ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """One forward + backward of an attention layer on a fresh copy of ``x`` with output cotangent ``dy``: the
    output ``"y"``, the input gradient ``"x"`` and every parameter gradient by name, and the logged indexer loss.
    ``run(x)`` replaces ``layer(x, packed=packed, indexer_loss_scale=indexer_loss_scale)`` (a compiled step, say)."""
    layer.zero_grad()
    x = x.detach().clone().requires_grad_()
    y = run(x) if run is not None else layer(x, packed=packed, indexer_loss_scale=indexer_loss_scale)
    (y * dy).sum().backward()
    out = {"y": y.detach(), "x": x.grad}
    out.update({n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
    return out, layer.last_indexer_loss


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in module.named_parameters()}


class _PoisonedTorch:
    """``torch`` as a kernel module sees it, with ``empty`` / ``empty_like`` returning NaN-filled floating tensors
    (integer ones filled with their dtype's largest value, an id or count no kernel writes): an output element a
    kernel leaves unwritten then fails the comparison instead of passing on stale memory."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def empty(self, *args, **kwargs) -> torch.Tensor:
        return _poison(self._real.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs) -> torch.Tensor:
        return _poison(self._real.empty_like(*args, **kwargs))


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype != torch.bool and not t.is_complex():
        return t.fill_(torch.iinfo(t.dtype).max)
    return t


def poison_kernel_outputs(monkeypatch, *modules) -> None:
    """Poison every buffer the host functions of ``modules`` allocate with ``torch.empty`` / ``torch.empty_like``
    (the kernels' outputs; floating ones with NaN) for the rest of the test."""
    for module in modules:
        monkeypatch.setattr(module, "torch", _PoisonedTorch(torch))
