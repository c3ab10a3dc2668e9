"""Sparse attention with ``deterministic=True``: ``dkv`` summed in exact int64 fixed point (csattn/ops/fixed_point.py).

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
from tests.ops.gluon_sm90 import compile_sm90
from tests.ops.sparse_attn_cases import NAMES, grads_of, launch_reference_grads, lowp_attn, packed_indices

DET = SparseAttnConfig(deterministic=True)  # sm_90: the Gluon backward's fixed-point variant, elsewhere the Triton pair
DET_PAIR = SparseAttnConfig(deterministic=True, bwd_gluon=0)  # the Triton pair everywhere


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
    config = SparseAttnConfig.parse(spec.pop("config", "")).replace(deterministic=True)
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


def test_only_the_config_selects_fixed_point(monkeypatch):
    """The config's flag alone picks the fixed-point sums: torch's deterministic mode (``csattn.deterministic_mode``)
    leaves the default config on fp32 atomics, and ``deterministic=True`` sums in fixed point outside it."""
    import csattn.ops.sparse_attn.triton as tri
    from csattn import deterministic_mode

    calls = []
    real = tri.fixed_point_scale
    monkeypatch.setattr(tri, "fixed_point_scale", lambda b: calls.append(1) or real(b))
    q, kv, sink, idx, do, dlse = _case(T=8, H=2, d=16, N=10, K=6, seed=3)

    def run(config):
        grads_of(lambda a, b, c: sparse_attn(a, b, idx, c, 0.25, backend="triton", config=config), q.float(),
                 kv.float(), sink, do, dlse)

    with deterministic_mode():
        run(None)
    assert not calls, "torch's deterministic mode changed the kernels' path"
    run(DET_PAIR)
    assert calls, "the fixed-point path did not run"


def _true_of_place(d: int) -> torch.Tensor:
    """The true dkv column at each place of the Gluon fixed-point variant's int64 row (``gluon_bwd.red_rows``): each
    64-column chunk in ``_stored_columns``' order (stored column ``f`` holds ``(f & 49) | (f & 2) << 2 |
    (f & 12) >> 1``), each 32-column half interleaved (place ``(f & 3) * 8 + (f >> 2)`` holds half column ``f``)."""
    f = torch.arange(64)
    true_of_stored = (f & 49) | (f & 2) << 2 | (f & 12) >> 1
    stored_of_place = f.clone()
    h = f & 31
    stored_of_place[(f & 32) + (h & 3) * 8 + (h >> 2)] = f
    chunk = true_of_stored[stored_of_place]
    return (torch.arange(d // 64)[:, None] * 64 + chunk[None, :]).reshape(d)


class _FixedGluonStandIn:
    """Stands in for the Gluon backward with ``FIXED`` on a CPU: ``[grid](**launch args)`` computes dq, dkv and
    dsink with the fp64 reference and adds ``round(dkv * 2**e)`` into the int64 launch buffer at the places the
    kernel writes (``_true_of_place``), so the host's side around it is what a test checks. A launch without
    ``FIXED`` is only recorded (``calls`` holds each launch's ``FIXED``)."""

    calls: list = []

    def __getitem__(self, grid):
        return self._run

    def _run(self, q, kv, idx, topk_len, sink, o, do, lse, dlse, dq, dkv, dsink_rows, fx, scale, HAS_LEN, HAS_DLSE,
             FIXED, **_):
        type(self).calls.append(FIXED)
        if not FIXED:
            return
        assert dkv.dtype == torch.int64
        g = launch_reference_grads(q, kv, idx, topk_len, sink, do, dlse, scale, HAS_LEN, HAS_DLSE)
        dq.copy_(g[0])
        dkv += torch.round(g[1][:, _true_of_place(kv.shape[1])] * fx[0].double()).long()
        dsink_rows.zero_()
        dsink_rows[0] = g[2]


def test_gluon_fixed_host_side(monkeypatch):
    """Where the Gluon backward applies (faked here) deterministic mode launches its fixed-point variant with an
    int64 buffer and ``fx``, and puts its sums back in true column order, returned or added into ``dkv_accum``
    (``dkv_accum_stored`` is refused); without ``deterministic`` it launches without ``FIXED``, with ``bwd_gluon=0``
    not at all."""
    from csattn.ops.sparse_attn import triton as kernels

    gen = torch.Generator().manual_seed(5)
    idx, N = packed_indices([40, 9], window=8, topk=12, ratio=4, pad_rows=2, gen=gen)
    T, H, d = idx.shape[0], 2, 128
    q, kv, sink = torch.randn(T, H, d, generator=gen), torch.randn(N, d, generator=gen), torch.randn(H, generator=gen)
    o, lse = (t.float() for t in sparse_attn_ref(q.double(), kv.double(), idx.long(), sink.double(), d**-0.5))
    do = torch.randn(T, H, d, generator=gen)
    plain = kernels.sparse_attn_bwd(q, kv, idx, sink, d**-0.5, o, lse, do, config=DET)  # the Triton pair
    monkeypatch.setattr(kernels, "_gluon_applies", lambda q, kv, cfg: True)
    monkeypatch.setattr(kernels, "_gluon_kernel", lambda name: _FixedGluonStandIn() if name == "bwd" else None)
    monkeypatch.setattr(kernels, "_programs", lambda n_work, device: 1)
    _FixedGluonStandIn.calls = []
    cfg = DET
    dq, dkv, dsink = kernels.sparse_attn_bwd(q, kv, idx, sink, d**-0.5, o, lse, do, config=cfg)
    assert _FixedGluonStandIn.calls == [True]
    assert not kernels.dkv_in_stored_order(q, kv, cfg)
    start = torch.randn(N, d, generator=gen)
    added = start.clone()
    assert kernels.sparse_attn_bwd(q, kv, idx, sink, d**-0.5, o, lse, do, config=cfg, dkv_accum=added)[1] is None
    for name, got, want in (("dq", dq, plain[0]), ("dkv", dkv, plain[1]), ("dkv_accum", added - start, plain[1]),
                            ("dsink", dsink, plain[2])):
        assert rel_err(got, want) < 1e-5, (name, rel_err(got, want))  # a column mix-up is O(1)
    with pytest.raises(ValueError, match="dkv_accum_stored"):
        kernels.sparse_attn_bwd(q, kv, idx, sink, d**-0.5, o, lse, do, config=cfg, dkv_accum=torch.zeros(N, d),
                                dkv_accum_stored=True)
    _FixedGluonStandIn.calls = []
    for other in (SparseAttnConfig(), DET_PAIR):
        kernels.sparse_attn_bwd(q, kv, idx, sink, d**-0.5, o, lse, do, config=other)
    assert _FixedGluonStandIn.calls == [False]  # the default launch; bwd_gluon=0 runs the Triton pair


@pytest.mark.slow  # a Triton build in a subprocess
def test_gluon_fixed_compiles_for_sm90():
    """The fixed-point variant (``FIXED``) compiles for sm_90 (and ptxas takes its inline asm): every reduction into
    dkv is a ``red.add.u64`` of a ``cvt.rni``-rounded value, four per pack, at the byte offsets of
    ``gluon_bwd.red_rows`` (8-byte elements: chunk ``c`` at ``512 c``, the hi half at ``+ 256``, a pack's places
    ``64`` apart)."""
    d = 512
    info = compile_sm90("bwd_fixed", 64, d, True)
    assert info["ptxas_rc"] == 0, info["ptxas"]
    assert set(info["atomics"]) == {"red.global.gpu.relaxed.add.u64"}, set(info["atomics"])
    # per tile instance (two: an item's last tile has its own): d / 64 chunks x 2 halves x 4 row pairs x 4 places
    assert len(info["atomics"]) == 2 * (d // 64) * 2 * 4 * 4
    assert info["cvt_s64"] == len(info["atomics"])
    want = sorted(c * 512 + h * 256 + j * 64 for c in range(d // 64) for h in range(2) for j in range(4))
    assert sorted(set(info["u64_offsets"])) == want


# ------------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------------


def _repeated_keys_case(dev: str = "cuda"):
    """H = 64, d = 512, 2048 rows each listing 640 ids drawn (with repeats, 10 % of them -1) from 48 keys: thousands
    of rows add into each key row. fp32 ``(q, kv, sink, do, dlse, idx, scale)`` on ``dev``."""
    gen = torch.Generator().manual_seed(21)
    T, H, d, N, K = 2048, 64, 512, 48, 640
    q = torch.randn(T, H, d, generator=gen).to(dev)
    kv = torch.randn(N, d, generator=gen).to(dev)
    sink = torch.randn(H, generator=gen).to(dev)
    do = torch.randn(T, H, d, generator=gen).to(dev)
    dlse = torch.zeros(T, H, device=dev)
    idx = torch.randint(0, N, (T, K), generator=gen)
    idx[torch.rand(T, K, generator=gen) < 0.1] = -1
    return q, kv, sink, do, dlse, idx.to(dev), d**-0.5


def _real_geometry_case(dev: str = "cuda"):
    """The real geometry (H = 64, d = 512, k = 512, W = 128) on a ragged pack with padding rows: bf16 q and kv,
    ``(q, kv, sink, do, dlse, idx, scale)`` on ``dev``."""
    gen = torch.Generator().manual_seed(11)
    idx, N = packed_indices([700, 37, 1500, 1800], window=128, topk=512, ratio=4, pad_rows=60, gen=gen)
    T, H, d = idx.shape[0], 64, 512
    q = torch.randn(T, H, d, generator=gen).to(dev).bfloat16()
    kv = torch.randn(N, d, generator=gen).to(dev).bfloat16()
    sink = torch.randn(H, generator=gen).to(dev)
    do = torch.randn(T, H, d, generator=gen).to(dev)
    dlse = torch.randn(T, H, generator=gen).to(dev) * 0.1
    return q, kv, sink, do, dlse, idx.to(dev), d**-0.5


# the two routes of deterministic mode's backward: the Triton pair (everywhere) and the Gluon kernel with FIXED (sm_90)
ROUTES = {"triton_pair": DET_PAIR, "gluon": DET}


def _route(name: str, q, kv) -> SparseAttnConfig:
    """The config of route ``name``, checked to take that route on these inputs (Gluon: skipped off sm_90)."""
    from csattn.ops.sparse_attn.triton import uses_gluon_bwd

    if name == "gluon" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are built for sm_90")
    cfg = ROUTES[name]
    assert uses_gluon_bwd(q, kv, cfg) == (name == "gluon")
    return cfg


@pytest.mark.gpu
@pytest.mark.parametrize("route", list(ROUTES))
def test_gpu_bitwise_with_repeated_keys(route):
    """The repeated-keys case (``_repeated_keys_case``, bf16): dkv, dq, dsink the same bits over five runs with
    ``deterministic=1``; accuracy against fp64 within 2x a same-dtype torch run's, as the default path's is
    (test_sparse_attn_triton.py); the Gluon route also within 1.5x the Triton pair's (the same rounding)."""
    q, kv, sink, do, dlse, idx, scale = _repeated_keys_case()
    dtype = torch.bfloat16
    q, kv = q.to(dtype), kv.to(dtype)
    cfg = _route(route, q, kv)

    def det_run(config):
        return grads_of(lambda a, b, c: sparse_attn(a, b, idx, c, scale, backend="triton", config=config),
                        q, kv, sink, do, dlse)

    runs = [det_run(cfg) for _ in range(5)]
    for r in runs[1:]:
        for name, a, b in zip(NAMES, runs[0], r):
            assert torch.equal(a, b), f"{name}: runs differ"
    ref = grads_of(lambda a, b, c: sparse_attn_ref(a, b, idx, c, scale, chunk_rows=256),
                   q.double(), kv.double(), sink.double(), do.double(), dlse.double())
    base = grads_of(lambda a, b, c: lowp_attn(a, b, idx, c, scale), q, kv, sink, do, dlse)
    for name, a, b, r in zip(NAMES, runs[0], base, ref):
        err, bound = rel_err(a, r), rel_err(b, r)
        assert torch.isfinite(a).all(), name
        assert err <= 2 * bound + 1e-5, f"{name}: {route} {err:.2e} vs same-dtype torch {bound:.2e}"
    if route == "gluon":
        for name, a, t, r in zip(NAMES, runs[0], det_run(DET_PAIR), ref):
            err, pair_err = rel_err(a, r), rel_err(t, r)
            assert err <= 1.5 * pair_err + 1e-5, f"{name}: gluon {err:.2e} vs the Triton pair {pair_err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("route", list(ROUTES))
def test_gpu_real_geometry_bitwise(route):
    """The real geometry (``_real_geometry_case``, bf16): deterministic dq, dkv, dsink the same bits over three runs
    and as close to fp64 as the default path's; through ``dkv_accum`` in two blocks of rows (as the layer core runs
    it) the same bits twice and close to the returned dkv."""
    from csattn.ops.sparse_attn.triton import sparse_attn_bwd, sparse_attn_fwd

    q, kv, sink, do, dlse, idx, scale = _real_geometry_case()
    cfg = _route(route, q, kv)
    runs = [grads_of(lambda a, b, c: sparse_attn(a, b, idx, c, scale, backend="triton", config=cfg),
                     q, kv, sink, do, dlse) for _ in range(3)]
    for r in runs[1:]:
        for name, a, b in zip(NAMES, runs[0], r):
            assert torch.equal(a, b), f"{name}: runs differ"
    default = grads_of(lambda a, b, c: sparse_attn(a, b, idx, c, scale, backend="triton"), q, kv, sink, do, dlse)
    ref = grads_of(lambda a, b, c: sparse_attn_ref(a, b, idx, c, scale, chunk_rows=512),
                   q.double(), kv.double(), sink.double(), do.double(), dlse.double())
    for name, a, b, r in zip(NAMES, runs[0], default, ref):
        err, err_default = rel_err(a, r), rel_err(b, r)
        assert torch.isfinite(a).all(), name
        assert err <= 1.5 * err_default + 1e-5, f"{name}: {route} {err:.2e} vs default {err_default:.2e}"
    o, lse = sparse_attn_fwd(q, kv, idx, sink, scale, config=cfg)
    do_b = do.bfloat16()
    dkv = sparse_attn_bwd(q, kv, idx, sink, scale, o, lse, do_b, dlse, config=cfg)[1].float()
    T = q.shape[0]
    accums = []
    for _ in range(2):
        accum = torch.zeros(kv.shape, device=kv.device)
        for lo, hi in ((0, T // 3), (T // 3, T)):
            sparse_attn_bwd(q[lo:hi], kv, idx[lo:hi], sink, scale, o[lo:hi], lse[lo:hi], do_b[lo:hi], dlse[lo:hi],
                            config=cfg, dkv_accum=accum)
        accums.append(accum)
    assert torch.equal(accums[0], accums[1]), "dkv_accum: runs differ"
    assert rel_err(accums[0], dkv) < 1e-2, rel_err(accums[0], dkv)  # dkv is bf16


@pytest.mark.gpu
def test_gpu_layer_backward_bitwise():
    """A CSA layer (sparse attention, indexer loss, compressor, the torch ops around them) on the Triton backend
    with ``AttentionConfig(deterministic=True)`` under torch's deterministic mode: output, input gradient and
    every parameter gradient the same bits over three steps."""
    from csattn import PackedSeqs, deterministic_mode
    from tests.helpers import layer_step, random_layer, tiny_config

    with deterministic_mode():
        cfg = tiny_config("csa", backend="triton", deterministic=True, hidden_size=256, num_heads=64, head_dim=64,
                          q_lora_rank=64, o_groups=8, o_lora_rank=32, sliding_window=64, index_topk=64)
        layer = random_layer(cfg, dtype=torch.float32).cuda().bfloat16()
        gen = torch.Generator().manual_seed(2)
        lengths = [1500, 300, 2200]
        x = torch.randn(sum(lengths), 256, generator=gen).cuda().bfloat16()
        dy = torch.randn(sum(lengths), 256, generator=gen).cuda().bfloat16()
        packed = PackedSeqs.from_lengths(lengths, device="cuda")
        runs = [layer_step(layer, x, dy, packed=packed)[0] for _ in range(3)]
    for r in runs[1:]:
        for name, g in runs[0].items():
            assert torch.equal(g, r[name]), f"{name}: steps differ"
