"""Small shared helpers for the tests."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

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


def _fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` quantized per 1x128 tile to e4m3 and back, in ``x``'s dtype (what the FP8 kernels feed
    their MMA, emulated)."""
    from csattn.ops.fp8.naive import _dequant_rows, quantize_1x128_ref

    flat = x.reshape(-1, x.shape[-1])
    return _dequant_rows(*quantize_1x128_ref(flat)).to(x.dtype).view(x.shape)


class _EmulatedFp8Linear(torch.autograd.Function):
    """``fp8_linear``'s FP8 recipe in plain PyTorch: the input quantized 1x128 in the forward, the output gradient
    quantized 1x128 in the backward, times the dequantized weight in the input's dtype."""

    @staticmethod
    def forward(ctx, x, weight, scale):
        from csattn.ops.fp8.naive import dequantize

        ctx.save_for_backward(weight, scale)
        return _fp8_round_trip(x) @ dequantize(weight, scale, x.dtype).T

    @staticmethod
    def backward(ctx, dy):
        from csattn.ops.fp8.naive import dequantize

        weight, scale = ctx.saved_tensors
        return _fp8_round_trip(dy) @ dequantize(weight, scale, dy.dtype), None, None


def emulate_fp8_compute(monkeypatch) -> None:
    """Make the FP8 ops' CPU references compute what the FP8 kernels compute (activations and output gradients
    quantized per 1x128 tile, fp64 elsewhere for fp64 inputs): "the same computation in plain PyTorch" that the
    GPU's FP8 model is held to."""
    import csattn.ops.fp8.grouped as grouped
    import csattn.ops.fp8.linear as linear
    from csattn.ops.fp8.naive import fp8_grouped_mm_ref

    monkeypatch.setattr(linear, "fp8_linear_ref", _EmulatedFp8Linear.apply)
    monkeypatch.setattr(grouped, "fp8_grouped_mm_ref",
                        lambda a, w, s, offs, trans=False: fp8_grouped_mm_ref(_fp8_round_trip(a), w, s, offs, trans))


def model_errors(loss: torch.Tensor, grads: dict[str, torch.Tensor], exact_loss: torch.Tensor,
                 exact_grads: dict[str, torch.Tensor], logits: torch.Tensor | None = None,
                 exact_logits: torch.Tensor | None = None) -> dict[str, float]:
    """A model run against the exact one: relative errors of the loss, the logits, every gradient as one vector
    (``"grads"``) and the median over the parameters of each one's (``"median"``). Per-parameter errors of a small
    random model are too spread to bound one by one (a gradient summing terms that cancel moves by O(1) under bf16
    rounding); these four move together, and a broken GEMM moves them all. Every parameter whose exact gradient is
    nonzero must have a finite gradient in ``grads`` (None or missing fails)."""
    names = [n for n, g in exact_grads.items() if g is not None and bool(g.abs().sum() > 0)]
    missing = [n for n in names if grads.get(n) is None]
    assert not missing, f"no gradient: {missing}"
    got = {n: grads[n].detach().double().cpu() for n in names}
    bad = [n for n, g in got.items() if not torch.isfinite(g).all()]
    assert not bad, f"non-finite gradients: {bad}"
    want = {n: exact_grads[n].detach().double().cpu() for n in names}
    out = {"loss": rel_err(loss.cpu(), exact_loss.cpu()),
           "grads": rel_err(torch.cat([got[n].flatten() for n in names]),
                            torch.cat([want[n].flatten() for n in names])),
           "median": statistics.median(rel_err(got[n], want[n]) for n in names)}
    if logits is not None:
        out["logits"] = rel_err(logits.cpu(), exact_logits.cpu())
    return out


def within_references(got: dict[str, float], *refs: dict[str, float], floor: float = 2**-8) -> dict:
    """The metrics of :func:`model_errors` that exceed twice the sum of the references' (runs whose error is
    expected: bf16 rounding, the FP8 recipe emulated in plain PyTorch) plus ``floor`` (the gradients' metrics; the
    loss's floor is 1e-4): ``{metric: (got, bound)}``, empty when all hold."""
    bounds = {k: 2 * sum(r[k] for r in refs) + (1e-4 if k == "loss" else floor) for k in got}
    return {k: (got[k], bounds[k]) for k in got if got[k] > bounds[k]}


def in_own_process(request, timeout: int = 600) -> bool:
    """For a GPU test of a kernel that may fault ("illegal instruction" ends the process's CUDA context, and every
    later test in it would fail): in the pytest run, runs this one test again in a child pytest, asserts it passed and
    returns False (the caller returns); in the child, returns True (the caller runs the test)."""
    node = request.node.nodeid
    if os.environ.get("CSATTN_TEST_CHILD") == node:
        return True
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", node],
                         cwd=request.config.rootpath, env={**os.environ, "CSATTN_TEST_CHILD": node},
                         capture_output=True, text=True, timeout=timeout)
    out = (run.stdout + run.stderr).strip().splitlines()
    print("\n".join(line for line in out if line.startswith(("gluon", "swap"))))
    assert run.returncode == 0, "\n".join(out[-40:])
    return False
