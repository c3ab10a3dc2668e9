"""The Hopper Gluon forward (``csattn/ops/sparse_attn/gluon_fwd.py``).

CPU: the kernel compiles for sm_90 with this Triton (no GPU needed) and issues the score product once, split
between the two warpgroups (its reason to exist), and the dispatch never picks it off sm_90 / for fp32.
GPU (sm_90): outputs and lse against fp64 at the real geometry and at other head counts / widths / lengths,
within 2x the error of a same-dtype PyTorch computation, and equal in distribution to the Triton kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from csattn.ops.sparse_attn import sparse_attn_ref
from tests.conftest import rel_err
from tests.test_sparse_attn_triton import lowp_attn, packed_indices

_COMPILE_SM90 = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from csattn.ops.sparse_attn.gluon_fwd import sparse_attn_fwd_gluon_kernel as fn

bk, d, has_len = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
sig = {"q": "*bf16", "kv": "*bf16", "idx": "*i64", "topk_len": "*i32", "sink": "*fp32", "o": "*bf16",
       "lse": "*fp32", **{f"stride_{n}": "i64" for n in ("qt", "qh", "kvn", "it", "ot", "oh", "lt")},
       "H": "i32", "K": "i32", "qk_scale_log2": "fp32"}
consts = {"HAS_LEN": has_len, "BH": 64, "BD": d, "BK": bk, "STAGES": 2}
sig.update({k: "constexpr" for k in consts})
# what the launcher's specialization sees at run time: 16-aligned pointers and strides
attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]]
         for k, v in sig.items() if v.startswith("*") or k.startswith("stride")}
src = GluonASTSource(fn=fn, signature=sig, attrs=attrs,
                     constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
ptx = kernel.asm["ptx"]
print(json.dumps({"wgmma_n": re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx),
                  "shared": kernel.metadata.shared, "cp_async": "cp.async" in ptx}))
"""


def _compile_sm90(bk: int, d: int, has_len: bool) -> dict:
    """Compile the kernel for sm_90 in a fresh process: the suite runs under TRITON_INTERPRET=1, which turns
    the Gluon library's own jit helpers into interpreter objects that the Gluon compiler refuses."""
    pytest.importorskip("triton.experimental.gluon")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_SM90, str(bk), str(d), "1" if has_len else "0"],
                         capture_output=True, text=True, env=env, timeout=300)
    if "has no attribute" in run.stderr and "gluon" in run.stderr:
        pytest.skip(f"this Triton's Gluon lacks an API the kernel uses: {run.stderr.splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("bk,d,has_len", [(64, 512, False), (32, 128, True)])
def test_compiles_for_sm90_with_split_score_product(bk, d, has_len):
    info = _compile_sm90(bk, d, has_len)
    wgmma = info["wgmma_n"]
    # Per key tile and warpgroup: the score product over d in k16 steps at N = BK / 2 (half of the keys),
    # and P V over BK in k16 steps at N = d / 2 (half of the columns). The Triton kernel issues the score
    # product at full width on both warpgroups; here nothing is issued twice.
    assert wgmma.count(str(bk // 2)) == d // 16, wgmma
    assert wgmma.count(str(d // 2)) == bk // 16, wgmma
    assert info["shared"] <= 227 * 1024
    assert info["cp_async"]


def test_dispatch_off_hopper_and_for_fp32():
    from csattn.ops.sparse_attn.triton import SparseAttnConfig, uses_gluon_fwd

    q = torch.zeros(4, 64, 512, dtype=torch.bfloat16)
    kv = torch.zeros(8, 512, dtype=torch.bfloat16)
    assert not uses_gluon_fwd(q, kv, SparseAttnConfig())  # CPU tensors
    if torch.cuda.is_available():
        cfg = SparseAttnConfig()
        cap = torch.cuda.get_device_capability()
        assert uses_gluon_fwd(q.cuda(), kv.cuda(), cfg) == (cap == (9, 0))
        assert not uses_gluon_fwd(q.cuda().float(), kv.cuda().float(), cfg)
        assert not uses_gluon_fwd(q.cuda()[:, :48], kv.cuda(), cfg)  # not a whole 64-head block
        assert not uses_gluon_fwd(q.cuda(), kv.cuda(), SparseAttnConfig(fwd_gluon=0))


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


GPU_CASES = {
    "real_geometry": dict(docs=[700, 37, 1500, 1800], H=64, d=512, W=128, k=512, pad=60, lengths=False),
    "two_head_blocks_d128": dict(docs=[300, 211, 5], H=128, d=128, W=64, k=64, pad=7, lengths=False),
    "topk_length_d256": dict(docs=[400, 90], H=64, d=256, W=32, k=96, pad=3, lengths=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(GPU_CASES), ids=list(GPU_CASES))
def test_gpu_gluon_forward(case, dtype):
    if not _hopper():
        pytest.skip("the Gluon forward is built for sm_90")
    from csattn.ops.sparse_attn.triton import SparseAttnConfig, sparse_attn_fwd, uses_gluon_fwd

    c = GPU_CASES[case]
    gen = torch.Generator().manual_seed(3)
    idx, N = packed_indices(c["docs"], window=c["W"], topk=c["k"], ratio=4, pad_rows=c["pad"], gen=gen)
    T, H, d = idx.shape[0], c["H"], c["d"]
    q = torch.randn(T, H, d, generator=gen).cuda()
    kv = torch.randn(N, d, generator=gen).cuda()
    sink = torch.randn(H, generator=gen).cuda()
    idx = idx.cuda()
    length = None
    ref_idx = idx
    if c["lengths"]:
        length = torch.randint(0, idx.shape[1] + 1, (T,), generator=gen).cuda()
        cols = torch.arange(idx.shape[1], device="cuda")
        ref_idx = torch.where(cols[None, :] < length[:, None], idx, -1)
    scale = d**-0.5
    assert uses_gluon_fwd(q.to(dtype), kv.to(dtype), SparseAttnConfig())
    gl_o, gl_lse = sparse_attn_fwd(q.to(dtype), kv.to(dtype), idx, sink, scale, length, SparseAttnConfig())
    tr_o, tr_lse = sparse_attn_fwd(q.to(dtype), kv.to(dtype), idx, sink, scale, length,
                                   SparseAttnConfig(fwd_gluon=0))
    ref_o, ref_lse = sparse_attn_ref(q.double(), kv.double(), ref_idx, sink.double(), scale, chunk_rows=512)
    base_o, base_lse = lowp_attn(q.to(dtype), kv.to(dtype), ref_idx, sink, scale)
    for name, a, tr, base, ref in (("o", gl_o, tr_o, base_o, ref_o), ("lse", gl_lse, tr_lse, base_lse, ref_lse)):
        assert torch.isfinite(a).all(), name
        err, bound, tr_err = rel_err(a, ref), rel_err(base, ref), rel_err(tr, ref)
        assert err <= 2 * bound + 1e-5, f"{name}: gluon {err:.2e} vs same-dtype torch {bound:.2e}"
        assert err <= 1.5 * tr_err + 1e-5, f"{name}: gluon {err:.2e} vs triton kernel {tr_err:.2e}"
    assert torch.all(gl_o[-c["pad"]:] == 0)
    torch.testing.assert_close(gl_lse[-c["pad"]:], sink.expand(c["pad"], H), rtol=0, atol=1e-6)
