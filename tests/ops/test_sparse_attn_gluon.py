"""The Hopper Gluon kernels: the forward (``gluon_fwd.py``) and the backward (``gluon_bwd.py``).

CPU: the kernels compile for sm_90 with this Triton (no GPU needed): the forward issues its score product once,
split between the two warpgroups; the backward runs two warp-specialized partitions whose products and
whole-line reductions are counted; the dispatch never picks them off sm_90 / for fp32.
GPU (sm_90): outputs, lse and every gradient against fp64 at the real geometry and at other head counts,
widths and lengths, within 2x the error of a same-dtype PyTorch computation and 1.5x the Triton kernels'.
"""

from __future__ import annotations

import pytest
import torch

from csattn.ops.sparse_attn import sparse_attn, sparse_attn_ref
from csattn.ops.sparse_attn.config import SparseAttnConfig
from tests.helpers import rel_err
from tests.ops.gluon_sm90 import compile_sm90
from tests.ops.sparse_attn_cases import NAMES, grads_of, launch_reference_grads, lowp_attn, packed_indices


@pytest.mark.slow  # a Triton build in a subprocess
@pytest.mark.parametrize("d,has_len", [(512, False), (256, True)])
def test_forward_compiles_for_sm90_warp_specialized(d, has_len):
    info = compile_sm90("fwd", 64, d, has_len)
    wgmma = info["wgmma_n"]
    # Each side: its whole score tile (m64n64, d / 16 k-steps), its P and the other side's against its column
    # half (N = d / 2, 4 k-steps each); the producer warpgroup gives registers back, the odd side some.
    assert wgmma.count("64") == 2 * d // 16, wgmma
    assert wgmma.count(str(d // 2)) == 2 * 2 * 4, wgmma
    cfg = SparseAttnConfig()
    assert ["dec", str(cfg.fwd_producer_regs)] in info["setmaxnreg"], info["setmaxnreg"]
    assert ["inc", str(cfg.fwd_side_regs)] in info["setmaxnreg"], info["setmaxnreg"]
    if info["spill_stores"] is not None:
        assert info["spill_stores"] == 0, info["spill_stores"]
    assert info["shared"] <= 227 * 1024
    assert info["cp_async"]


@pytest.mark.slow  # a Triton build in a subprocess
@pytest.mark.parametrize("d,has_len", [(512, True), (256, False)])
def test_backward_compiles_for_sm90_warp_specialized(d, has_len):
    info = compile_sm90("bwd", 64, d, has_len)
    wgmma = info["wgmma_n"]
    # Score warpgroup: S and dP whole (N = 64 keys, d / 16 k-steps each), its half of dS K at N = d / 2 (4 k-steps
    # over the 64 keys). Key warpgroup: the other half of dS K, then d / 64 chunks of P^T dO + dS^T Q at N = 64
    # (2 products x 4 k-steps over the 64 heads). The key warpgroup's tile is built twice: an item's last tile is
    # its own instance (it also hands q and dO over to the next item).
    assert wgmma.count(str(d // 2)) == 4 + 2 * 4, wgmma
    assert wgmma.count("64") == 2 * d // 16 + 2 * (d // 64) * 2 * 4, wgmma
    # The reductions into dkv are whole-line vectors: one v4 per thread, chunk and row it holds (8 rows), written
    # as red (no result) by gluon_bwd._red_v4_asm with every Triton version.
    assert set(info["atomics"]) == {"red.global.gpu.relaxed.add.v4.f32"}, info["atomics"]
    assert len(info["atomics"]) == 2 * (d // 64) * 8
    # Two partitions with their own register budgets: the key warpgroup gives some back, the score one takes 256.
    assert ["dec", "240"] in info["setmaxnreg"] and ["inc", "256"] in info["setmaxnreg"], info["setmaxnreg"]
    # The MMAs' shared-memory descriptors stay in the tile loop (gluon_bwd._buffers): hoisted, they spill 1.3 KB
    # with Triton 3.6 (the kernel ran 30 % slower) and 660 bytes with 3.9. What remains: with 3.6 (what the kernel is
    # measured with) 28 bytes, outside the tile loops; with 3.9 72 bytes at d = 512, a few values of the score
    # warpgroup's tile loop among them.
    import triton

    if info["spill_stores"] is not None:
        assert info["spill_stores"] <= (64 if triton.__version__.startswith("3.6") else 128), info["spill_stores"]
    assert info["shared"] <= 227 * 1024
    assert info["cp_async"]


def test_dispatch_off_hopper_for_fp32_and_old_triton(monkeypatch):
    import triton

    from csattn.ops.backend import triton_version
    from csattn.ops.sparse_attn import triton as kernels
    from csattn.ops.sparse_attn.triton import SparseAttnConfig, uses_gluon_bwd, uses_gluon_fwd

    # the lookup and the version are cached per process (another test in this process may have read the version)
    kernels._gluon_kernel.cache_clear()
    triton_version.cache_clear()
    with monkeypatch.context() as m:  # an older Gluon API: the Triton kernels run
        m.setattr(triton, "__version__", "3.5.1")
        assert kernels._gluon_kernel("fwd") is None and kernels._gluon_kernel("bwd") is None
    kernels._gluon_kernel.cache_clear()
    triton_version.cache_clear()

    q = torch.zeros(4, 64, 512, dtype=torch.bfloat16)
    kv = torch.zeros(8, 512, dtype=torch.bfloat16)
    for uses in (uses_gluon_fwd, uses_gluon_bwd):
        assert not uses(q, kv, SparseAttnConfig())  # CPU tensors
        if torch.cuda.is_available():
            cfg = SparseAttnConfig()
            cap = torch.cuda.get_device_capability()
            assert uses(q.cuda(), kv.cuda(), cfg) == (cap == (9, 0))
            assert not uses(q.cuda().float(), kv.cuda().float(), cfg)
            assert not uses(q.cuda()[:, :48], kv.cuda(), cfg)  # not a whole 64-head block
            assert not uses(q.cuda(), kv.cuda(), SparseAttnConfig(fwd_gluon=0, bwd_gluon=0))


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def test_dkv_columns_puts_the_kernels_column_order_back():
    """The backward's sums keep each 64-column chunk in the order of ``_stored_columns`` (stored column f holds
    column (f & 49) | (f & 2) << 2 | (f & 12) >> 1); ``dkv_columns`` writes or adds them in true order."""
    from csattn.ops.sparse_attn.triton import dkv_columns

    f = torch.arange(64)
    true_of_stored = (f & 49) | (f & 2) << 2 | (f & 12) >> 1
    assert sorted(true_of_stored.tolist()) == list(range(64))
    N, D = 3, 256
    true = torch.arange(N * D, dtype=torch.float32).view(N, D)
    stored = true.view(N, D // 64, 64)[:, :, true_of_stored].reshape(N, D)
    out = torch.empty(N, D, dtype=torch.float64)
    dkv_columns(stored, out, accumulate=False)
    assert torch.equal(out, true.double())
    dkv_columns(stored, out, accumulate=True)
    assert torch.equal(out, 2 * true.double())


class _StoredOrderBackward:
    """Stands in for the Gluon backward on a CPU: ``[grid](**launch args)`` computes dq, dkv and dsink with the
    fp64 reference and adds dkv into the launch's buffer in the kernel's stored column order, so the host's
    bookkeeping around it (which buffer, when ``dkv_columns`` runs) is what a test then checks."""

    calls = 0

    def __getitem__(self, grid):
        return self._run

    def _run(self, q, kv, idx, topk_len, sink, o, do, lse, dlse, dq, dkv, dsink_rows, scale, HAS_LEN, HAS_DLSE,
             FIXED, **_):
        type(self).calls += 1
        assert not FIXED
        g = launch_reference_grads(q, kv, idx, topk_len, sink, do, dlse, scale, HAS_LEN, HAS_DLSE)
        f = torch.arange(64)
        N, D = kv.shape
        dq.copy_(g[0])
        dkv += g[1].view(N, D // 64, 64)[:, :, (f & 49) | (f & 2) << 2 | (f & 12) >> 1].reshape(N, D).float()
        dsink_rows.zero_()
        dsink_rows[0] = g[2]


def _fake_gluon_backward(monkeypatch):
    from csattn.ops.sparse_attn import triton as kernels

    monkeypatch.setattr(kernels, "uses_gluon_bwd", lambda q, kv, cfg: True)
    monkeypatch.setattr(kernels, "_gluon_kernel", lambda name: _StoredOrderBackward())
    monkeypatch.setattr(kernels, "_programs", lambda n_work, device: 1)
    _StoredOrderBackward.calls = 0


def test_sparse_attn_bwd_sums_stored_order_into_a_callers_buffer(monkeypatch):
    """With the Gluon backward, ``dkv`` comes back in true order from the kernel's stored order, whether returned,
    added into ``dkv_accum``, or kept in stored order there (``dkv_accum_stored``) and put in order by the caller;
    ``dkv_accum_stored`` without the Gluon backward is refused."""
    from csattn.ops.sparse_attn.triton import dkv_columns, dkv_in_stored_order, sparse_attn_bwd

    gen = torch.Generator().manual_seed(7)
    idx, N = packed_indices([40, 9], window=8, topk=12, ratio=4, pad_rows=2, gen=gen)
    T, H, d = idx.shape[0], 2, 128
    q, kv, sink = torch.randn(T, H, d, generator=gen), torch.randn(N, d, generator=gen), torch.randn(H, generator=gen)
    o, lse = (t.float() for t in sparse_attn_ref(q.double(), kv.double(), idx.long(), sink.double(), d**-0.5))
    do = torch.randn(T, H, d, generator=gen)
    with pytest.raises(ValueError, match="dkv_accum_stored"):
        sparse_attn_bwd(q, kv, idx, sink, d**-0.5, o, lse, do, dkv_accum=torch.zeros(N, d), dkv_accum_stored=True)
    plain = sparse_attn_bwd(q, kv, idx, sink, d**-0.5, o, lse, do)[1]  # the Triton kernels
    _fake_gluon_backward(monkeypatch)
    assert dkv_in_stored_order(q, kv)
    returned = sparse_attn_bwd(q, kv, idx, sink, d**-0.5, o, lse, do)[1]
    start = torch.randn(N, d, generator=gen)
    added = start.clone()
    assert sparse_attn_bwd(q, kv, idx, sink, d**-0.5, o, lse, do, dkv_accum=added)[1] is None
    stored = torch.zeros(N, d)
    for lo, hi in ((0, 20), (20, T)):  # block by block, as the layer core runs it
        sparse_attn_bwd(q[lo:hi], kv, idx[lo:hi], sink, d**-0.5, o[lo:hi], lse[lo:hi], do[lo:hi], dkv_accum=stored,
                        dkv_accum_stored=True)
    in_order = torch.empty(N, d)
    dkv_columns(stored, in_order, accumulate=False)
    assert _StoredOrderBackward.calls == 4
    for got in (returned, added - start, in_order):
        assert rel_err(got, plain) < 1e-5, rel_err(got, plain)


@pytest.mark.slow  # a layer or model through the Triton interpreter
def test_layer_core_keeps_the_key_gradient_in_stored_order(monkeypatch):
    """The layer core, block by block, with a backward that sums the key gradient in the Gluon kernel's stored
    column order: the same gradients as with the Triton kernels (the core keeps its sum in that order and puts it
    in order once)."""
    from csattn import PackedSeqs
    from tests.helpers import random_layer, tiny_config

    cfg = tiny_config("csa", backend="triton", head_dim=64, workspace_bytes=1 << 12)
    packed = PackedSeqs.from_lengths([30, 3, 27], [32, 4, 28])

    def grads():
        layer = random_layer(cfg).float()
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
        layer(x, packed=packed).square().sum().backward()
        return {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters() if p.grad is not None}}

    plain = grads()
    _fake_gluon_backward(monkeypatch)
    faked = grads()
    assert _StoredOrderBackward.calls >= 2  # several blocks
    assert faked.keys() == plain.keys()
    for name in plain:  # fp32 kernels against the fp64 stand-in: 1e-7 apart; a column mix-up is O(1)
        assert rel_err(faked[name], plain[name]) < 1e-5, (name, rel_err(faked[name], plain[name]))


def _gpu_inputs(T: int, H: int, d: int, N: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """fp32 ``q [T, H, d]``, ``kv [N, d]``, ``sink [H]``, ``do [T, H, d]``, ``dlse [T, H]`` on the GPU, drawn from
    ``gen`` in that order."""
    q = torch.randn(T, H, d, generator=gen).cuda()
    kv = torch.randn(N, d, generator=gen).cuda()
    sink = torch.randn(H, generator=gen).cuda()
    do = torch.randn(T, H, d, generator=gen).cuda()
    return q, kv, sink, do, torch.randn(T, H, generator=gen).cuda() * 0.1


GPU_CASES = {
    "real_geometry": dict(docs=[700, 37, 1500, 1800], H=64, d=512, W=128, k=512, pad=60, lengths=False),
    "two_head_blocks_d128": dict(docs=[300, 211, 5], H=128, d=128, W=64, k=64, pad=7, lengths=False),
    "topk_length_d256": dict(docs=[400, 90], H=64, d=256, W=32, k=96, pad=3, lengths=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["", "bwd_gluon=0"], ids=["gluon", "gluon_fwd_only"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(GPU_CASES), ids=list(GPU_CASES))
def test_gpu_gluon_kernels(case, dtype, variant):
    """Forward and backward with the Gluon kernels against fp64 and against the Triton kernels."""
    if not _hopper():
        pytest.skip("the Gluon kernels are built for sm_90")
    from csattn.ops.sparse_attn.triton import SparseAttnConfig, uses_gluon_bwd, uses_gluon_fwd

    c = GPU_CASES[case]
    gen = torch.Generator().manual_seed(3)
    idx, N = packed_indices(c["docs"], window=c["W"], topk=c["k"], ratio=4, pad_rows=c["pad"], gen=gen)
    T, H, d = idx.shape[0], c["H"], c["d"]
    q, kv, sink, do, dlse = _gpu_inputs(T, H, d, N, gen)
    idx = idx.cuda()
    length = None
    ref_idx = idx
    if c["lengths"]:
        length = torch.randint(0, idx.shape[1] + 1, (T,), generator=gen).cuda()
        cols = torch.arange(idx.shape[1], device="cuda")
        ref_idx = torch.where(cols[None, :] < length[:, None], idx, -1)
    scale = d**-0.5
    assert uses_gluon_fwd(q.to(dtype), kv.to(dtype), SparseAttnConfig())
    assert uses_gluon_bwd(q.to(dtype), kv.to(dtype), SparseAttnConfig())

    def fused(spec):
        config = SparseAttnConfig.parse(spec)
        return grads_of(lambda a, b, s: sparse_attn(a, b, idx, s, scale, topk_length=length, backend="triton",
                                                    config=config),
                        q.to(dtype), kv.to(dtype), sink, do, dlse)

    gluon, tri = fused(variant), fused("fwd_gluon=0,bwd_gluon=0")
    ref = grads_of(lambda a, b, s: sparse_attn_ref(a, b, ref_idx, s, scale, chunk_rows=512),
                   q.double(), kv.double(), sink.double(), do.double(), dlse.double())
    base = grads_of(lambda a, b, s: lowp_attn(a, b, ref_idx, s, scale), q.to(dtype), kv.to(dtype), sink, do, dlse)
    for name, a, t, b, r in zip(NAMES, gluon, tri, base, ref):
        assert torch.isfinite(a).all(), name
        err, bound, tri_err = rel_err(a, r), rel_err(b, r), rel_err(t, r)
        assert err <= 2 * bound + 1e-5, f"{name}: gluon {err:.2e} vs same-dtype torch {bound:.2e}"
        assert err <= 1.5 * tri_err + 1e-5, f"{name}: gluon {err:.2e} vs triton kernels {tri_err:.2e}"
    assert torch.all(gluon[0][-c["pad"]:] == 0) and torch.all(gluon[2][-c["pad"]:] == 0)
    torch.testing.assert_close(gluon[1][-c["pad"]:], sink.expand(c["pad"], H), rtol=0, atol=1e-6)


@pytest.mark.gpu
def test_gpu_gluon_forward_is_deterministic():
    """The forward has a fixed summation order and no atomics, so repeated runs on the same inputs give the same
    bits; a shared-memory race in the key slots, the q reload or the exchanges between the sides shows up as a
    run that differs. Rows without keys sit between rows with keys (``topk_length``), and int32 index lists (read
    whole, where int64 ones are read by their low words for the score mask) give the same bits."""
    if not _hopper():
        pytest.skip("the Gluon kernels are built for sm_90")
    from csattn.ops.sparse_attn.triton import sparse_attn_fwd

    gen = torch.Generator().manual_seed(5)
    idx, N = packed_indices([3000, 17, 2100, 900], window=128, topk=512, ratio=4, pad_rows=40, gen=gen)
    T, H, d = idx.shape[0], 64, 512
    q = torch.randn(T, H, d, generator=gen).cuda().bfloat16()
    kv = torch.randn(N, d, generator=gen).cuda().bfloat16()
    sink = torch.randn(H, generator=gen).cuda()
    idx = idx.cuda()
    length = torch.randint(0, idx.shape[1] + 1, (T,), generator=gen).cuda()
    length[::5] = 0
    config = SparseAttnConfig()
    o0, lse0 = sparse_attn_fwd(q, kv, idx, sink, d**-0.5, topk_length=length, config=config)
    for _ in range(20):
        o, lse = sparse_attn_fwd(q, kv, idx, sink, d**-0.5, topk_length=length, config=config)
        assert torch.equal(o, o0) and torch.equal(lse, lse0)
    assert torch.isfinite(o0).all() and torch.isfinite(lse0).all()
    o32, lse32 = sparse_attn_fwd(q, kv, idx.int(), sink, d**-0.5, topk_length=length, config=config)
    assert torch.equal(o32, o0) and torch.equal(lse32, lse0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_gpu_gluon_skips_only_empty_tiles(dtype, ids_dtype):
    """A row ends at its last tile holding an id >= 0. Rows here hold their ids in one, two or none of ten 64-key
    tiles (first, middle, last, only the last slot of the list, trailing / leading / interior tiles of -1), beside
    full rows. A valid tile skipped is an O(1) error: every output and gradient must stay within 2x the same-dtype
    error of fp64 and within 1.5x the Triton kernels' error (they run every tile), and rows without ids give
    zeros."""
    if not _hopper():
        pytest.skip("the Gluon kernels are built for sm_90")

    gen = torch.Generator().manual_seed(11)
    T, H, d, K, BK, N = 700, 64, 512, 640, 64, 3000
    idx = torch.randint(0, N, (T, K), generator=gen)
    keep = torch.zeros(T, K // BK, dtype=torch.bool)
    pattern = torch.arange(T) % 8
    keep[pattern == 0] = True  # full rows
    keep[pattern == 1, 0] = True  # the first tile only: nine trailing tiles of -1
    keep[pattern == 2, 4] = True  # a middle tile only
    keep[pattern == 3, -1] = True  # the last tile only: nine leading tiles of -1
    keep[pattern == 4, 2] = keep[pattern == 4, 7] = True  # tiles of -1 between and after
    rand = torch.rand(T, K // BK, generator=gen) < 0.3
    keep[pattern == 5] = rand[pattern == 5]  # random tiles, some rows none
    # pattern 6: no ids at all; pattern 7: only the list's last slot
    idx = torch.where(keep.repeat_interleave(BK, dim=1), idx, -1)
    # within kept tiles, some ids -1 too, the tile's last ones included
    idx = torch.where(torch.rand(T, K, generator=gen) < 0.2, -1, idx)
    idx[pattern == 7] = -1
    idx[pattern == 7, -1] = 5
    q, kv, sink, do, dlse = _gpu_inputs(T, H, d, N, gen)
    idx = idx.cuda()
    scale = d**-0.5

    def fused(spec):
        config = SparseAttnConfig.parse(spec)
        return grads_of(lambda a, b, s: sparse_attn(a, b, idx.to(ids_dtype), s, scale, backend="triton",
                                                    config=config),
                        q.to(dtype), kv.to(dtype), sink, do, dlse)

    gluon, tri = fused(""), fused("fwd_gluon=0,bwd_gluon=0")
    ref = grads_of(lambda a, b, s: sparse_attn_ref(a, b, idx, s, scale, chunk_rows=512),
                   q.double(), kv.double(), sink.double(), do.double(), dlse.double())
    base = grads_of(lambda a, b, s: lowp_attn(a, b, idx, s, scale), q.to(dtype), kv.to(dtype), sink, do, dlse)
    for name, a, t, b, r in zip(NAMES, gluon, tri, base, ref):
        assert torch.isfinite(a).all(), name
        err, bound, tri_err = rel_err(a, r), rel_err(b, r), rel_err(t, r)
        assert err <= 2 * bound + 1e-5, f"{name}: gluon {err:.2e} vs same-dtype torch {bound:.2e}"
        assert err <= 1.5 * tri_err + 1e-5, f"{name}: gluon {err:.2e} vs triton kernels {tri_err:.2e}"
    empty = (idx < 0).all(1)
    assert empty.sum() >= 80 and torch.all(gluon[0][empty] == 0)
