"""Sparse attention with ``deterministic=1``: ``dkv`` summed in exact int64 fixed point (csattn/ops/fixed_point.py).

CPU (TRITON_INTERPRET=1, conftest): fp32 outputs and every gradient against the fp64 reference at the tolerance of
``test_sparse_attn_triton.py``, repeated keys and rows without keys included, and the same bits over two runs (and
through ``dkv_accum``). GPU (``-m gpu``): bf16 at H = 64, d = 512 with every row picking from a few dozen keys
(thousands of rows adding into each key row, keys repeated within rows: where fp32 atomics change order run to
run), the same bits over five runs and the same accuracy as the default path; and a CSA layer's whole backward
(attention + indexer loss) bitwise equal over three runs.
"""

from __future__ import annotations

import pytest
import torch

from csattn.ops.sparse_attn import SparseAttnConfig, sparse_attn, sparse_attn_ref
from tests.helpers import poison_kernel_outputs, rel_err
from tests.ops.sparse_attn_cases import NAMES, grads_of, lowp_attn, packed_indices

DET = SparseAttnConfig(deterministic=1)


@pytest.fixture(autouse=True)
def _poisoned_kernel_outputs(monkeypatch):
    """Every kernel output starts as NaN, so an element the kernel does not write fails."""
    import csattn.ops.sparse_attn.triton

    poison_kernel_outputs(monkeypatch, csattn.ops.sparse_attn.triton)


def _case(T, H, d, N, K, seed, p_skip=0.3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, d, generator=gen, dtype=torch.float64)
    kv = torch.randn(N, d, generator=gen, dtype=torch.float64)
    sink = torch.randn(H, generator=gen)
    idx = torch.randint(0, N, (T, K), generator=gen)
    idx[torch.rand(T, K, generator=gen) < p_skip] = -1
    idx[1] = -1  # a row without keys
    idx[2, :3] = idx[2, 3]  # a key listed several times in one row
    do = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    dlse = torch.randn(T, H, generator=gen, dtype=torch.float64)
    return q, kv, sink, idx, do, dlse


CASES = {
    "basic": dict(T=20, H=4, d=64, N=30, K=12),
    "head_blocks": dict(T=10, H=20, d=32, N=16, K=12, config="bh=16,bk_fwd=16,bk_dq=16,bk_dkv=16"),
    "key_blocks": dict(T=14, H=4, d=32, N=20, K=40, config="bk_fwd=16,bk_dq=16,bk_dkv=16"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_deterministic_matches_reference(case, assert_close):
    spec = dict(CASES[case])
    config = SparseAttnConfig.parse(spec.pop("config", "")).replace(deterministic=1)
    q, kv, sink, idx, do, dlse = _case(seed=list(CASES).index(case), **spec)
    scale = spec["d"] ** -0.5
    ref = grads_of(lambda a, b, c: sparse_attn_ref(a, b, idx, c.double(), scale), q, kv, sink, do, dlse)
    runs = [grads_of(lambda a, b, c: sparse_attn(a, b, idx, c, scale, backend="triton", config=config),
                     q.float(), kv.float(), sink, do, dlse) for _ in range(2)]
    for name, a, b in zip(NAMES, runs[0], ref):
        assert_close(a, b, 2e-5, f"{case} {name}")
    for name, a, b in zip(NAMES, *runs):
        assert torch.equal(a, b), f"{case} {name}: two runs differ"


def test_topk_length_and_dkv_accum(assert_close):
    """``topk_length`` and the layer core's ``dkv_accum`` (blocks of rows adding into one fp32 sum)."""
    from csattn.ops.sparse_attn.triton import sparse_attn_bwd, sparse_attn_fwd

    q, kv, sink, idx, do, _ = _case(T=16, H=4, d=32, N=24, K=10, seed=7, p_skip=0.1)
    q, kv, do = q.float(), kv.float(), do.float()
    length = torch.randint(0, 11, (16,), generator=torch.Generator().manual_seed(1))
    scale = 32**-0.5
    o, lse = sparse_attn_fwd(q, kv, idx, sink, scale, topk_length=length, config=DET)
    _, dkv, _ = sparse_attn_bwd(q, kv, idx, sink, scale, o, lse, do, topk_length=length, config=DET)
    leaves = [x.detach().double().requires_grad_() for x in (q, kv)]
    cols = torch.arange(idx.shape[1])
    idx_len = torch.where(cols[None, :] < length[:, None], idx, -1)
    o_ref, _ = sparse_attn_ref(leaves[0], leaves[1], idx_len, sink.double(), scale)
    o_ref.backward(do.double())
    assert_close(dkv, leaves[1].grad, 2e-5, "dkv with topk_length")
    accum = torch.zeros(kv.shape)
    for lo, hi in ((0, 7), (7, 16)):  # two blocks of rows in turn
        o_b, lse_b = sparse_attn_fwd(q[lo:hi], kv, idx[lo:hi], sink, scale, topk_length=length[lo:hi], config=DET)
        sparse_attn_bwd(q[lo:hi], kv, idx[lo:hi], sink, scale, o_b, lse_b, do[lo:hi], topk_length=length[lo:hi],
                        config=DET, dkv_accum=accum)
    assert_close(accum, leaves[1].grad, 2e-5, "dkv_accum")


def test_torch_deterministic_mode_selects_fixed_point(monkeypatch):
    """Under ``torch.use_deterministic_algorithms(True)`` the default config sums dkv in fixed point too."""
    import csattn.ops.sparse_attn.triton as tri

    calls = []
    real = tri.fixed_point_scale
    monkeypatch.setattr(tri, "fixed_point_scale", lambda b: calls.append(1) or real(b))
    q, kv, sink, idx, do, dlse = _case(T=8, H=2, d=16, N=10, K=6, seed=3)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        grads_of(lambda a, b, c: sparse_attn(a, b, idx, c, 0.25, backend="triton"), q.float(), kv.float(), sink,
                 do, dlse)
    finally:
        torch.use_deterministic_algorithms(before)
    assert calls, "the fixed-point path did not run"
    calls.clear()
    grads_of(lambda a, b, c: sparse_attn(a, b, idx, c, 0.25, backend="triton"), q.float(), kv.float(), sink, do, dlse)
    assert not calls, "the default path changed"


# ------------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_bitwise_with_repeated_keys():
    """H = 64, d = 512, 2048 rows each listing 640 ids drawn (with repeats) from 48 keys: dkv, dq, dsink the same
    bits over five runs with ``deterministic=1``; its accuracy against fp64 within 2x a same-dtype torch run's, as
    the default path's is (test_sparse_attn_triton.py); the Gluon backward is not used."""
    from csattn.ops.sparse_attn.triton import uses_gluon_bwd

    gen = torch.Generator().manual_seed(21)
    T, H, d, N, K = 2048, 64, 512, 48, 640
    dev = "cuda"
    q = torch.randn(T, H, d, generator=gen).to(dev)
    kv = torch.randn(N, d, generator=gen).to(dev)
    sink = torch.randn(H, generator=gen).to(dev)
    do = torch.randn(T, H, d, generator=gen).to(dev)
    dlse = torch.zeros(T, H, device=dev)
    idx = torch.randint(0, N, (T, K), generator=gen)
    idx[torch.rand(T, K, generator=gen) < 0.1] = -1
    idx = idx.to(dev)
    scale = d**-0.5
    dtype = torch.bfloat16
    assert not uses_gluon_bwd(q.to(dtype), kv.to(dtype), DET)
    runs = [grads_of(lambda a, b, c: sparse_attn(a, b, idx, c, scale, backend="triton", config=DET),
                     q.to(dtype), kv.to(dtype), sink, do, dlse) for _ in range(5)]
    for r in runs[1:]:
        for name, a, b in zip(NAMES, runs[0], r):
            assert torch.equal(a, b), f"{name}: runs differ"
    ref = grads_of(lambda a, b, c: sparse_attn_ref(a, b, idx, c, scale, chunk_rows=256),
                   q.to(dtype).double(), kv.to(dtype).double(), sink.double(), do.double(), dlse.double())
    base = grads_of(lambda a, b, c: lowp_attn(a, b, idx, c, scale), q.to(dtype), kv.to(dtype), sink, do, dlse)
    for name, a, b, r in zip(NAMES, runs[0], base, ref):
        err, bound = rel_err(a, r), rel_err(b, r)
        assert torch.isfinite(a).all(), name
        assert err <= 2 * bound + 1e-5, f"{name}: deterministic {err:.2e} vs same-dtype torch {bound:.2e}"


@pytest.mark.gpu
def test_gpu_real_geometry_bitwise():
    """bf16 at the real geometry (H = 64, d = 512, k = 512, W = 128) on a ragged pack: deterministic dkv equals
    itself over three runs and is as close to fp64 as the default path's."""
    gen = torch.Generator().manual_seed(11)
    idx, N = packed_indices([700, 37, 1500, 1800], window=128, topk=512, ratio=4, pad_rows=60, gen=gen)
    T, H, d = idx.shape[0], 64, 512
    dev = "cuda"
    q = torch.randn(T, H, d, generator=gen).to(dev).bfloat16()
    kv = torch.randn(N, d, generator=gen).to(dev).bfloat16()
    sink = torch.randn(H, generator=gen).to(dev)
    do = torch.randn(T, H, d, generator=gen).to(dev)
    dlse = torch.randn(T, H, generator=gen).to(dev) * 0.1
    idx = idx.to(dev)
    scale = d**-0.5
    runs = [grads_of(lambda a, b, c: sparse_attn(a, b, idx, c, scale, backend="triton", config=DET),
                     q, kv, sink, do, dlse) for _ in range(3)]
    for r in runs[1:]:
        for name, a, b in zip(NAMES, runs[0], r):
            assert torch.equal(a, b), f"{name}: runs differ"
    default = grads_of(lambda a, b, c: sparse_attn(a, b, idx, c, scale, backend="triton"), q, kv, sink, do, dlse)
    ref = grads_of(lambda a, b, c: sparse_attn_ref(a, b, idx, c, scale, chunk_rows=512),
                   q.double(), kv.double(), sink.double(), do.double(), dlse.double())
    for name, a, b, r in zip(NAMES, runs[0], default, ref):
        err, err_default = rel_err(a, r), rel_err(b, r)
        assert err <= 1.5 * err_default + 1e-5, f"{name}: deterministic {err:.2e} vs default {err_default:.2e}"


@pytest.mark.gpu
def test_gpu_layer_backward_bitwise():
    """A CSA layer (sparse attention, indexer loss, compressor, the torch ops around them) on the Triton backend
    with ``AttentionConfig(deterministic=True)`` under torch's deterministic mode: output, input gradient and
    every parameter gradient the same bits over three steps."""
    from csattn import PackedSeqs, set_deterministic
    from tests.helpers import layer_step, random_layer, tiny_config

    before = torch.are_deterministic_algorithms_enabled()
    set_deterministic(True)
    try:
        cfg = tiny_config("csa", backend="triton", deterministic=True, hidden_size=256, num_heads=64, head_dim=64,
                          q_lora_rank=64, o_groups=8, o_lora_rank=32, sliding_window=64, index_topk=64)
        layer = random_layer(cfg, dtype=torch.float32).cuda().bfloat16()
        gen = torch.Generator().manual_seed(2)
        lengths = [1500, 300, 2200]
        x = torch.randn(sum(lengths), 256, generator=gen).cuda().bfloat16()
        dy = torch.randn(sum(lengths), 256, generator=gen).cuda().bfloat16()
        packed = PackedSeqs.from_lengths(lengths, device="cuda")
        runs = [layer_step(layer, x, dy, packed=packed)[0] for _ in range(3)]
    finally:
        set_deterministic(before)
    for r in runs[1:]:
        for name, g in runs[0].items():
            assert torch.equal(g, r[name]), f"{name}: steps differ"
