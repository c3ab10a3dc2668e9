"""Kernel launch settings are values handed to the host functions (``config=``), never read from the
environment or a module-global dict: a bad key names itself, the backward launches with the forward's settings
even when a default changes in between, and the layer's ``AttentionConfig.sparse_attn_kernel`` reaches every
launch of the core (forward, the backward's recomputed forward, the backward)."""

from __future__ import annotations

import json

import pytest
import torch

from csattn import PackedSeqs
from csattn.models.deepseek_v4.config import DeepseekV4ModelConfig
from csattn.ops.indexer import IndexerConfig
from csattn.ops.indexer_loss import IndexerLossConfig
from csattn.ops.sparse_attn import SparseAttnConfig, sparse_attn
from tests.helpers import random_layer, tiny_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs on CUDA, or the interpreter (conftest)
SMALL = "bk_fwd=16,bk_dq=16,bk_dkv=16,warps_fwd=4"


@pytest.mark.parametrize("cls", [SparseAttnConfig, IndexerConfig, IndexerLossConfig])
def test_bad_key_names_itself(cls):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: unknown key 'bogus_key'"):
        cls.parse("bogus_key=3")
    with pytest.raises(ValueError, match="unknown key 'bogus_key'"):
        cls.from_dict({"bogus_key": 3})
    with pytest.raises(ValueError, match="unknown key 'bogus_key'"):
        cls().replace(bogus_key=3)
    first = cls.keys()[0]
    with pytest.raises(ValueError, match=rf"{first}='x' is not an int"):
        cls.parse(f"{first}=x")
    with pytest.raises(ValueError, match="not key=value"):
        cls.parse(first)


def test_parse_spec_round_trip():
    cfg = SparseAttnConfig.parse(f" {SMALL}, fwd_gluon=0 ")
    assert (cfg.bk_fwd, cfg.bk_dq, cfg.bk_dkv, cfg.warps_fwd, cfg.fwd_gluon) == (16, 16, 16, 4, 0)
    assert SparseAttnConfig.parse(cfg.spec()) == cfg and SparseAttnConfig.parse("") == SparseAttnConfig()
    assert SparseAttnConfig().spec() == "" and SparseAttnConfig.from_dict(cfg.as_dict()) == cfg
    with pytest.raises(AttributeError):
        cfg.bk_fwd = 32  # frozen: a config handed out cannot change under a saved autograd node
    assert IndexerConfig.parse("register_row=8,seg=16") == IndexerConfig(register_row=8, seg=16)


def test_variants_not_kept_are_gone():
    """The variants measured and not kept (lab/NOTES.md) are no settings at all: parsing one names the key, and
    the custom ops' spec carries the public config only."""
    from csattn.ops.sparse_attn.custom_ops import _config

    for key in ("fwd_persistent", "bwd_persistent", "bwd_full_lines", "skip_empty_tiles"):
        assert key not in SparseAttnConfig.keys() and not hasattr(SparseAttnConfig(), key)
        with pytest.raises(ValueError, match=f"unknown key '{key}'"):
            SparseAttnConfig.parse(f"{key}=0")
    assert "verbose" not in SparseAttnConfig.keys() and "radix" not in IndexerConfig.keys()
    small = SparseAttnConfig.parse(SMALL)
    assert _config(small.spec()) == small and _config("") is None


def test_attention_config_takes_the_kernel_settings():
    assert tiny_config("csa").sparse_attn_kernel is None
    for given in (SMALL, SparseAttnConfig.parse(SMALL), SparseAttnConfig.parse(SMALL).as_dict()):
        assert tiny_config("csa", sparse_attn_kernel=given).sparse_attn_kernel == SparseAttnConfig.parse(SMALL)
    with pytest.raises(ValueError, match="unknown key 'bk_fwdd'"):
        tiny_config("csa", sparse_attn_kernel="bk_fwdd=16")


def test_model_config_passes_the_kernel_settings_through():
    cfg = DeepseekV4ModelConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, head_dim=16,
                                partial_rotary_factor=0.5, q_lora_rank=16, o_groups=2, o_lora_rank=8,
                                index_n_heads=2, index_head_dim=8, sparse_attn_kernel=SMALL)
    assert all(cfg.attention_config(i).sparse_attn_kernel == SparseAttnConfig.parse(SMALL) for i in range(2))
    assert json.loads(json.dumps(cfg.training_dict()))["sparse_attn_kernel"] == SMALL
    assert "sparse_attn_kernel" not in cfg.to_hf_dict()
    assert DeepseekV4ModelConfig.from_hf({**cfg.to_hf_dict(), **cfg.training_dict()}) == cfg
    with pytest.raises(ValueError, match="unknown key 'nope'"):
        DeepseekV4ModelConfig(num_hidden_layers=1, sparse_attn_kernel="nope=1")


def _spy(monkeypatch, module, name, seen):
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        seen.append((name, kwargs["config"] if "config" in kwargs else args[{"sparse_attn_fwd": 6,
                                                                              "sparse_attn_bwd": 10}[name]]))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


@pytest.mark.parametrize("given", [None, SMALL], ids=["defaults", "explicit"])
def test_backward_uses_the_forward_config(given, monkeypatch, assert_close):
    """The autograd function keeps the forward's config: changing the module default (and setting the old
    environment variable) between forward and backward changes nothing, and the gradients equal a run
    without the change."""
    from csattn.ops.sparse_attn import triton as kernels

    seen: list = []
    _spy(monkeypatch, kernels, "sparse_attn_fwd", seen)
    _spy(monkeypatch, kernels, "sparse_attn_bwd", seen)
    config = None if given is None else SparseAttnConfig.parse(given)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(9, 4, 32, generator=gen).requires_grad_()
    kv = torch.randn(20, 32, generator=gen).requires_grad_()
    sink = torch.randn(4, generator=gen).requires_grad_()
    idx = torch.randint(-1, 20, (9, 40), generator=gen, dtype=torch.int32)
    do = torch.randn(9, 4, 32, generator=gen)

    def run(change_between: bool):
        o, _ = sparse_attn(q, kv, idx, sink, 32**-0.5, backend="triton", config=config)
        if change_between:
            monkeypatch.setattr(kernels, "_DEFAULT", SparseAttnConfig(bk_fwd=32, bk_dq=32, bk_dkv=32, bh=16))
            monkeypatch.setenv("CSATTN_SPARSE_ATTN_CONFIG", "bogus_key=1")
        return [o.detach(), *torch.autograd.grad(o, (q, kv, sink), do)]

    changed = run(True)
    (_, fwd_cfg), (_, bwd_cfg) = seen[-2:]
    assert [n for n, _ in seen[-2:]] == ["sparse_attn_fwd", "sparse_attn_bwd"]
    assert bwd_cfg is fwd_cfg and fwd_cfg == (config or SparseAttnConfig())
    monkeypatch.undo()
    plain = run(False)
    for name, a, b in zip(["o", "dq", "dkv", "dsink"], changed, plain):
        assert torch.equal(a, b), name


@pytest.mark.slow  # a layer or model through the Triton interpreter
def test_layer_core_launches_with_the_layer_config(monkeypatch):
    """``AttentionConfig.sparse_attn_kernel`` reaches the core's forward, the backward's recomputed forward and
    the backward (through ``CoreGeometry``), also when the module default changes after the forward."""
    pytest.importorskip("triton")
    from csattn.ops.sparse_attn import triton as kernels

    seen: list = []
    _spy(monkeypatch, kernels, "sparse_attn_fwd", seen)
    _spy(monkeypatch, kernels, "sparse_attn_bwd", seen)
    cfg = tiny_config("csa", backend="triton", sparse_attn_kernel=SMALL, workspace_bytes=1 << 12)
    layer = random_layer(cfg).to(DEVICE, torch.float32)
    packed = PackedSeqs.from_lengths([30, 3, 27], [32, 4, 28], device=DEVICE)
    x = torch.randn(64, 32, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0)).requires_grad_()
    y = layer(x, packed=packed)
    forward_launches = len(seen)
    monkeypatch.setattr(kernels, "_DEFAULT", SparseAttnConfig(bk_fwd=32))
    y.square().sum().backward()
    assert forward_launches >= 1 and len(seen) > forward_launches
    assert {name for name, _ in seen} == {"sparse_attn_fwd", "sparse_attn_bwd"}
    assert all(c == SparseAttnConfig.parse(SMALL) for _, c in seen), seen


def test_no_kernel_settings_from_the_environment():
    """Nothing in the package reads kernel settings from the environment (TRITON_INTERPRET checks aside)."""
    from pathlib import Path

    import csattn

    root = Path(csattn.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "CSATTN_SPARSE_ATTN" not in text, path
        assert "SCORE_TILES" not in text and "LOSS_TILES" not in text, path


def test_indexer_loss_backward_uses_the_forward_config(monkeypatch):
    """The indexer loss's autograd function launches its backward with the forward's config too."""
    pytest.importorskip("triton")
    from csattn.ops.indexer_loss import indexer_kl_loss
    from csattn.ops.indexer_loss import triton as kernels

    seen: list = []
    real = kernels.indexer_kl_bwd

    def spy(*args, **kwargs):
        seen.append(kwargs["config"])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "indexer_kl_bwd", spy)
    gen = torch.Generator().manual_seed(4)
    T, HI, CI, H, D, Nc, K = 12, 2, 16, 2, 16, 9, 4
    q_idx = torch.randn(T, HI, CI, generator=gen).requires_grad_()
    w = torch.randn(T, HI, generator=gen).requires_grad_()
    k_idx = torch.randn(Nc, CI, generator=gen).requires_grad_()
    q, ckv = torch.randn(T, H, D, generator=gen), torch.randn(Nc, D, generator=gen)
    lse = torch.randn(T, H, generator=gen) + 4
    selected = torch.randint(-1, Nc, (T, K), generator=gen)
    config = IndexerLossConfig(bk_fwd=16, bk_bwd=16)
    loss = indexer_kl_loss(q_idx, w, k_idx, q, ckv, lse, D**-0.5, torch.full((T,), 1 / T), selected=selected,
                           backend="triton", config=config)
    monkeypatch.setattr(kernels, "_DEFAULT", IndexerLossConfig(bk_bwd=32))
    loss.backward()
    assert seen == [config] and seen[0] is config


def _spy_config(monkeypatch, module, name, seen):
    """Record the ``config=`` keyword of every call of ``module.name``."""
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        seen.append((name, kwargs.get("config")))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


@pytest.mark.slow  # a layer or model through the Triton interpreter
@pytest.mark.parametrize("capture_safe", [False, True], ids=["eager", "capture-safe"])
def test_layer_indexer_kernels_launch_with_the_layer_config(capture_safe, monkeypatch):
    """``AttentionConfig.indexer_kernel`` / ``indexer_loss_kernel`` reach every launch of the indexer's scores and
    selection and of the indexer loss (forward and backward), on the default ops and through the custom ops."""
    pytest.importorskip("triton")
    from csattn.ops.indexer import IndexerConfig
    from csattn.ops.indexer import triton as topk_kernels
    from csattn.ops.indexer_loss import IndexerLossConfig
    from csattn.ops.indexer_loss import triton as loss_kernels

    seen: list = []
    for name in ("indexer_scores_fwd", "select_topk"):
        _spy_config(monkeypatch, topk_kernels, name, seen)
    for name in ("indexer_kl_fwd", "indexer_kl_bwd"):
        _spy_config(monkeypatch, loss_kernels, name, seen)
    if capture_safe:  # the static top-k imported the kernel functions by name
        from csattn.ops.indexer import capture_safe_triton

        for name in ("indexer_scores_fwd", "select_topk"):
            _spy_config(monkeypatch, capture_safe_triton, name, seen)
    topk_cfg, loss_cfg = "bt=128,seg=1024", "bk_fwd=16,bk_bwd=32"
    cfg = tiny_config("csa", backend="triton", indexer_kernel=topk_cfg, indexer_loss_kernel=loss_cfg,
                      indexer_loss_coeff=0.1, capture_safe=capture_safe)
    layer = random_layer(cfg).to(DEVICE, torch.float32)
    packed = PackedSeqs.from_lengths([30, 3, 27], [32, 4, 28], device=DEVICE)
    x = torch.randn(64, 32, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0)).requires_grad_()
    layer(x, packed=packed).square().sum().backward()
    names = {name for name, _ in seen}
    assert {"indexer_scores_fwd", "select_topk", "indexer_kl_fwd", "indexer_kl_bwd"} <= names, names
    want = {"indexer_scores_fwd": IndexerConfig.parse(topk_cfg), "select_topk": IndexerConfig.parse(topk_cfg),
            "indexer_kl_fwd": IndexerLossConfig.parse(loss_cfg), "indexer_kl_bwd": IndexerLossConfig.parse(loss_cfg)}
    assert all(c == want[name] for name, c in seen), seen
