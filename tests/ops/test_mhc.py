"""mHC at the module and model level: the reference's weights (Sinkhorn output close to doubly stochastic),
backend resolution, what one site keeps for the backward on the Triton path (the streams and a few floats per
row, no fp32 copy of the streams), and the whole model with its mHC sites on the Triton kernels (CPU
interpreter) equal to the reference model: logits, losses and every parameter gradient."""

from __future__ import annotations

import copy

import pytest
import torch

from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig
from csattn.models.deepseek_v4.mhc import HyperConnection, HyperHead
from csattn.models.deepseek_v4.model import future_tokens
from csattn.ops.mhc import hc_pre_ref, resolve_backend
from csattn.packing import PackedSeqs
from tests.helpers import rel_err
from tests.models.model_utils import randomize_model_, tiny_config_dict

pytest.importorskip("csattn.ops.mhc.triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter (conftest)


def test_reference_comb_is_nearly_doubly_stochastic():
    g = torch.Generator().manual_seed(0)
    n, d = 4, 16
    x = torch.randn(7, n, d, dtype=torch.float64, generator=g)
    fn = 0.1 * torch.randn((2 + n) * n, n * d, dtype=torch.float64, generator=g)
    post, comb, collapsed = hc_pre_ref(x, fn, torch.zeros((2 + n) * n, dtype=torch.float64),
                                       torch.ones(3, dtype=torch.float64), 20, 1e-6, 1e-6)
    assert torch.allclose(comb.sum(-2), torch.ones(7, n, dtype=torch.float64), atol=1e-5)  # columns, last
    assert torch.allclose(comb.sum(-1), torch.ones(7, n, dtype=torch.float64), atol=1e-3)
    assert bool(((post > 0) & (post < 2)).all()) and collapsed.shape == (7, d)


def test_resolve_backend():
    cpu = torch.zeros(1)
    assert resolve_backend("auto", cpu) == "reference"
    assert resolve_backend("triton", cpu) == "triton"
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda", cpu)


def _saved_bytes_per_row(backend: str, t: int, n: int, d: int) -> tuple[float, list[torch.Tensor]]:
    """Bytes one site (pre-mapping + combine) saves for the backward per row, parameters left out, each
    storage counted once."""
    torch.manual_seed(0)
    hc = HyperConnection(d, n, 20, 1e-6, 1e-6, backend=backend).to(DEVICE)
    x = torch.randn(t, n, d, device=DEVICE).bfloat16().requires_grad_()
    y = torch.randn(t, d, device=DEVICE).bfloat16().requires_grad_()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        site = hc(x)
        hc.combine(site.streams, y, site.post, site.comb)
    params = {p.untyped_storage().data_ptr() for p in hc.parameters()}
    storages = {}
    for s in saved:
        ptr = s.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = s.untyped_storage().nbytes()
    return sum(storages.values()) / t, saved


def test_triton_site_saves_streams_and_per_row_floats_only():
    t, n, d = 48, 4, 40
    width = (2 + n) * n
    per_row, saved = _saved_bytes_per_row("triton", t, n, d)
    assert not any(s.dtype == torch.float32 and s.numel() >= t * n * d for s in saved)
    # the bf16 streams and block output, the [T, M] logits, rstd, post and comb
    bound = 2 * n * d + 2 * d + 4 * (width + 1 + n + n * n)
    assert per_row <= bound, f"{per_row} bytes per row > {bound}"
    # the plain-autograd reference keeps fp32 copies of the streams (8 bytes per element or more)
    ref_per_row, ref_saved = _saved_bytes_per_row("reference", t, n, d)
    assert any(s.dtype == torch.float32 and s.numel() >= t * n * d for s in ref_saved)
    assert ref_per_row > 2 * bound


def test_config_backend_reaches_every_mhc_module():
    cfg = DeepseekV4ModelConfig.from_hf(tiny_config_dict("mixed", mtp=1), backend="triton")
    model = DeepseekV4ForCausalLM(cfg)
    mods = [m for m in model.modules() if isinstance(m, (HyperConnection, HyperHead))]
    assert len(mods) == 2 * 4 + 2 and all(m.backend == "triton" for m in mods)


def _step(model, ids, packed, dy):
    labels = future_tokens(ids, packed, 2)
    out = model(ids, packed=packed, labels=labels[0], mtp_labels=labels[1:])
    (out.loss + (out.logits * dy).sum()).backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow  # a layer or model through the Triton interpreter
def test_model_with_triton_mhc_matches_reference():
    """fp64 model, attention and MoE on the reference; every mHC site, combine and head on the kernels."""
    cfg = DeepseekV4ModelConfig.from_hf(tiny_config_dict("mixed", mtp=1), backend="reference")
    torch.manual_seed(1)
    ref = DeepseekV4ForCausalLM(cfg)
    randomize_model_(ref, 2)
    ref = ref.to(DEVICE, torch.float64)
    fused = copy.deepcopy(ref)
    for m in fused.modules():
        if isinstance(m, (HyperConnection, HyperHead)):
            m.backend = "triton"
    packed = PackedSeqs.from_lengths([13, 6])
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (19,), generator=g).to(DEVICE)
    dy = torch.randn(19, 64, dtype=torch.float64, generator=g).to(DEVICE)
    out_ref, grads_ref = _step(ref, ids, packed, dy)
    out, grads = _step(fused, ids, packed, dy)
    assert rel_err(out.logits, out_ref.logits) < 1e-12
    assert abs(float(out.loss.detach() - out_ref.loss.detach())) < 1e-12
    assert set(grads) == set(grads_ref) and any(".attn_hc." in k for k in grads)
    for name, gr in grads_ref.items():
        assert rel_err(grads[name], gr) < 1e-10, f"grad {name}: {rel_err(grads[name], gr):.2e}"


def test_reference_ignores_autocast():
    """The reference mHC computes its weights in fp32 whatever autocast says (its mixing GEMM and the combine's
    run with autocast off), as the fused kernels do: under autocast a site, the head and the combine give what
    they give without it, bit for bit, so a site rebuilt in the backward (outside autocast) is the one the
    forward made."""
    from csattn.ops.mhc import hc_combine, hc_head, hc_site

    g = torch.Generator().manual_seed(0)
    n, d, t = 4, 16, 9
    streams = torch.randn(t, n, d, generator=g)
    fn, base, scale = 0.1 * torch.randn((2 + n) * n, n * d, generator=g), torch.randn((2 + n) * n, generator=g), \
        1 + 0.1 * torch.randn(3, generator=g)
    head_fn, norm_w, y = 0.1 * torch.randn(n, n * d, generator=g), 1 + 0.1 * torch.randn(d, generator=g), \
        torch.randn(t, d, generator=g).bfloat16()
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6, norm_weight=norm_w, backend="reference")

    def run():
        site = hc_site(streams, fn, base, scale, **kw)
        out = hc_combine(site.streams, y, site.post, site.comb, backend="reference")
        head = hc_head(streams, head_fn, base[:n], scale[:1], hc_eps=1e-6, norm_eps=1e-6, norm_weight=norm_w,
                       backend="reference")
        return site.post, site.comb, site.x, out, head, site.again(streams)

    plain = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = run()
    for name, a, b in zip(("post", "comb", "x", "combine", "head", "again"), plain, under):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), name
    assert torch.equal(under[2], under[5])  # the rebuilt block input is the forward's
