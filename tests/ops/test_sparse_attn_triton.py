"""Fused Triton sparse attention vs the reference: outputs, lse and every gradient (q, kv, sink, via lse too).

CPU: the kernels run under TRITON_INTERPRET=1 (conftest sets it) on tiny shapes, fp32 against fp64.
GPU: bf16 at the real geometry (H=64, d=512, k+W=640) on ragged packs, judged against the error of a
same-dtype PyTorch computation.
"""

from __future__ import annotations

import pytest
import torch

from csattn.ops.sparse_attn import SparseAttnConfig, sparse_attn, sparse_attn_ref
from tests.helpers import poison_kernel_outputs, rel_err
from tests.ops.sparse_attn_cases import NAMES, grads_of, lowp_attn, packed_indices


@pytest.fixture(autouse=True)
def _poisoned_kernel_outputs(monkeypatch):
    """Every kernel output starts as NaN, so an element the kernel does not write fails."""
    import csattn.ops.sparse_attn.triton

    poison_kernel_outputs(monkeypatch, csattn.ops.sparse_attn.triton)


def random_case(T, H, d, N, K, gen, p_skip=0.3, dtype=torch.float64):
    q = torch.randn(T, H, d, generator=gen, dtype=dtype)
    kv = torch.randn(N, d, generator=gen, dtype=dtype)
    sink = torch.randn(H, generator=gen, dtype=torch.float32)
    idx = torch.randint(0, N, (T, K), generator=gen)
    idx[torch.rand(T, K, generator=gen) < p_skip] = -1
    return q, kv, sink, idx


CPU_CASES = {
    "basic": dict(T=20, H=4, d=64, N=30, K=12),
    "odd_heads_odd_dim": dict(T=17, H=3, d=48, N=25, K=9),
    "two_heads": dict(T=12, H=2, d=32, N=12, K=20),  # K > BK: several key blocks
    "head_blocks": dict(T=10, H=20, d=32, N=16, K=12, config="bh=16,bk_fwd=16,bk_dq=16,bk_dkv=16"),
    "key_blocks": dict(T=14, H=4, d=32, N=20, K=40, config="bk_fwd=16,bk_dq=16,bk_dkv=16"),
    "odd_key_count": dict(T=12, H=3, d=48, N=20, K=70),  # two key blocks of 64, the second partly masked
    "wide_fp32": dict(T=5, H=2, d=512, N=9, K=8),  # fp32 at d = 512: the tiles shrink to fit
    "kv_row_stride": dict(T=14, H=4, d=32, N=20, K=12, kv_pad=8),
}


@pytest.mark.parametrize("case", list(CPU_CASES), ids=list(CPU_CASES))
def test_matches_reference(case, assert_close):
    spec = dict(CPU_CASES[case])
    config = SparseAttnConfig.parse(spec.pop("config", ""))
    pad = spec.pop("kv_pad", 0)
    # the seed follows the case's place in the table, not hash(): str hashes change with PYTHONHASHSEED
    gen = torch.Generator().manual_seed(list(CPU_CASES).index(case))
    q, kv, sink, idx = random_case(gen=gen, **spec)
    idx[1] = -1  # an empty row: o = 0, lse = sink
    idx[2, :3] = idx[2, 3]  # a key listed several times counts several times, as in the reference
    do = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    dlse = torch.randn(q.shape[:2], generator=gen, dtype=torch.float64)
    scale = spec["d"] ** -0.5
    ref = grads_of(lambda a, b, c: sparse_attn_ref(a, b, idx, c.double(), scale), q, kv, sink, do, dlse)

    def tri_fn(a, b, c):
        if pad:  # kv as a view with row stride d + pad
            b = torch.cat([b, b.new_zeros(b.shape[0], pad)], 1)[:, : b.shape[1]]
        return sparse_attn(a, b, idx.to(torch.int32), c, scale, backend="triton", config=config)

    tri = grads_of(tri_fn, q.float(), kv.float(), sink, do, dlse)
    for name, a, b in zip(NAMES, tri, ref):
        assert_close(a, b, 2e-5, f"{case} {name}")
    assert tri[0].dtype == torch.float32 and tri[1].dtype == torch.float32
    assert torch.all(tri[0][1] == 0)
    torch.testing.assert_close(tri[1][1], sink, rtol=0, atol=1e-6)


def test_topk_length_and_unused_lse(assert_close):
    gen = torch.Generator().manual_seed(7)
    q, kv, sink, idx = random_case(T=16, H=4, d=32, N=24, K=10, gen=gen, p_skip=0.1)
    length = torch.randint(0, 11, (16,), generator=gen)
    do = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    scale = 32**-0.5

    def run(backend, a, b, c):
        leaves = [x.detach().clone().requires_grad_() for x in (a, b, c)]
        o, _ = sparse_attn(*leaves[:2], idx, leaves[2], scale, topk_length=length, backend=backend)
        o.backward(do.to(o.dtype))  # lse unused: its gradient arrives as None
        return [o] + [x.grad for x in leaves]

    ref = run("reference", q, kv, sink.double())
    tri = run("triton", q.float(), kv.float(), sink)
    for name, a, b in zip(["o", "dq", "dkv", "dsink"], tri, ref):
        assert_close(a, b, 2e-5, f"topk_length {name}")


def test_realistic_index_lists(assert_close):
    """Window + selected compressed keys over a ragged pack with padding rows (tiny sizes)."""
    gen = torch.Generator().manual_seed(3)
    idx, N = packed_indices([9, 1, 14], window=4, topk=3, ratio=4, pad_rows=2, gen=gen)
    T, H, d = idx.shape[0], 2, 32
    q = torch.randn(T, H, d, generator=gen, dtype=torch.float64)
    kv = torch.randn(N, d, generator=gen, dtype=torch.float64)
    sink = torch.randn(H, generator=gen)
    do = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    dlse = torch.zeros(T, H, dtype=torch.float64)
    ref = grads_of(lambda a, b, c: sparse_attn_ref(a, b, idx, c.double(), d**-0.5), q, kv, sink, do, dlse)
    tri = grads_of(lambda a, b, c: sparse_attn(a, b, idx, c, d**-0.5, backend="triton"),
                   q.float(), kv.float(), sink, do, dlse)
    for name, a, b in zip(NAMES, tri, ref):
        assert_close(a, b, 2e-5, f"packed {name}")
    assert torch.all(tri[0][-2:] == 0)  # padding rows attend to nothing


def test_no_rows():
    q, kv = torch.zeros(0, 2, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    sink = torch.zeros(2, requires_grad=True)
    o, lse = sparse_attn(q, kv, torch.zeros(0, 3, dtype=torch.long), sink, 0.25, backend="triton")
    assert o.shape == (0, 2, 16) and lse.shape == (0, 2)
    o.sum().backward()
    assert torch.all(kv.grad == 0) and torch.all(sink.grad == 0)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(q=a["q"][0]), "q must be"),
        (lambda a: a.update(kv=a["kv"][:, :8]), "kv must be"),
        (lambda a: a.update(kv=a["kv"].double()), "kv dtype"),
        (lambda a: a.update(indices=a["indices"].float()), "indices must be int"),
        (lambda a: a.update(indices=a["indices"][:3]), "indices must be"),
        (lambda a: a.update(sink=a["sink"][:1]), "sink must be"),
        (lambda a: a.update(topk_length=torch.ones(3, dtype=torch.int64)), "topk_length"),
    ],
    ids=["q_rank", "kv_dim", "kv_dtype", "idx_dtype", "idx_rows", "sink_shape", "len_shape"],
)
def test_bad_arguments(mutate, match):
    gen = torch.Generator().manual_seed(0)
    q, kv, sink, idx = random_case(T=6, H=2, d=16, N=8, K=4, gen=gen, dtype=torch.float32)
    args = dict(q=q, kv=kv, indices=idx, sink=sink, scale=0.25)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        sparse_attn(**args, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        sparse_attn(q, kv, idx, sink, 0.25, backend="flash")


@pytest.mark.slow  # a layer or model through the Triton interpreter
@pytest.mark.parametrize("layer_type", ["sliding", "csa", "hca"])
def test_layer_with_triton_backend(layer_type, assert_close):
    """The layer's sparse attention call (window + compressed keys, packed, padded) through the dispatch:
    output, input gradient and every parameter gradient equal the reference backend's (fp32)."""
    from csattn import PackedSeqs
    from tests.helpers import grads, random_layer, tiny_config

    runs = {}
    for backend in ("reference", "triton"):
        layer = random_layer(tiny_config(layer_type, backend=backend), dtype=torch.float32)
        x = torch.randn(24, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()
        y = layer(x, packed=PackedSeqs.from_lengths([13, 7], [16, 8]))
        y = y[0] if isinstance(y, tuple) else y
        (y * torch.arange(y.numel()).reshape(y.shape).sin()).sum().backward()
        runs[backend] = (y, x.grad, grads(layer))
    (y_r, dx_r, g_r), (y_t, dx_t, g_t) = runs["reference"], runs["triton"]
    assert_close(y_t, y_r, 1e-5, "y")
    assert_close(dx_t, dx_r, 1e-5, "dx")
    for name, g in g_r.items():
        if g is not None:
            assert_close(g_t[name], g, 1e-5, name)


# ------------------------------------------------------------------------------------------------------
# GPU: bf16 at the real geometry
# ------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_real_geometry(dtype):
    gen = torch.Generator().manual_seed(11)
    idx, N = packed_indices([700, 37, 1500, 1800], window=128, topk=512, ratio=4, pad_rows=60, gen=gen)
    T, H, d = idx.shape[0], 64, 512
    dev = "cuda"
    q = torch.randn(T, H, d, generator=gen).to(dev)
    kv = torch.randn(N, d, generator=gen).to(dev)
    sink = torch.randn(H, generator=gen).to(dev)
    do = torch.randn(T, H, d, generator=gen).to(dev)
    dlse = torch.randn(T, H, generator=gen).to(dev) * 0.1
    idx = idx.to(dev)
    scale = d**-0.5
    ref = grads_of(lambda a, b, c: sparse_attn_ref(a, b, idx, c, scale, chunk_rows=512),
                   q.double(), kv.double(), sink.double(), do.double(), dlse.double())
    base = grads_of(lambda a, b, c: lowp_attn(a, b, idx, c, scale), q.to(dtype), kv.to(dtype), sink, do, dlse)
    tri = grads_of(lambda a, b, c: sparse_attn(a, b, idx, c, scale, backend="triton"),
                   q.to(dtype), kv.to(dtype), sink, do, dlse)
    for name, a, b, r in zip(NAMES, tri, base, ref):
        err, bound = rel_err(a, r), rel_err(b, r)
        assert torch.isfinite(a).all(), name
        assert err <= 2 * bound + 1e-5, f"{name}: triton {err:.2e} vs same-dtype torch {bound:.2e}"
    assert torch.all(tri[0][-60:] == 0)


@pytest.mark.gpu
def test_gpu_fp32_many_heads(assert_close):
    """fp32 (exact products) with H=128: two head blocks per row, both adding into dkv."""
    gen = torch.Generator().manual_seed(5)
    idx, N = packed_indices([300, 211], window=64, topk=64, ratio=4, pad_rows=5, gen=gen)
    T, H, d = idx.shape[0], 128, 192
    q, kv = torch.randn(T, H, d, generator=gen).cuda(), torch.randn(N, d, generator=gen).cuda()
    sink, idx = torch.randn(H, generator=gen).cuda(), idx.cuda()
    do, dlse = torch.randn(T, H, d, generator=gen).cuda(), torch.randn(T, H, generator=gen).cuda()
    ref = grads_of(lambda a, b, c: sparse_attn_ref(a, b, idx, c, d**-0.5),
                   q.double(), kv.double(), sink.double(), do.double(), dlse.double())
    tri = grads_of(lambda a, b, c: sparse_attn(a, b, idx, c, d**-0.5, backend="triton"),
                   q, kv, sink, do, dlse)
    for name, a, b in zip(NAMES, tri, ref):
        assert_close(a, b, 1e-5, f"fp32 {name}")
