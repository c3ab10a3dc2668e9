"""Builds a Gluon sparse-attention kernel for sm_90 on any machine (no GPU needed) and reports what its PTX holds:
spills (ptxas -v), MMA shapes, shared memory, the reductions into ``dkv`` and their offsets."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import json, re, sys
from tests.ops.gluon_sm90 import build_sm90
from csattn.ops.sparse_attn.config import SparseAttnConfig
from csattn.ops.sparse_attn.gluon_bwd import sparse_attn_bwd_gluon_kernel
from csattn.ops.sparse_attn.gluon_fwd import sparse_attn_fwd_gluon_kernel

which, bk, d, has_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
strides = ("qt", "qh", "kvn", "it", "ot", "oh", "lt")
if which == "fwd":
    fn = sparse_attn_fwd_gluon_kernel
    sig = {"q": "*bf16", "kv": "*bf16", "idx": "*i64", "topk_len": "*i32", "sink": "*fp32", "o": "*bf16",
           "lse": "*fp32", **{f"stride_{n}": "i64" for n in strides}, "K": "i32", "qk_scale_log2": "fp32",
           "n_work": "i32", "n_hb": "i32"}
    cfg = SparseAttnConfig()
    consts = {"HAS_LEN": has_len, "BH": 64, "BD": d, "BK": bk, "SIDE1_REGS": cfg.fwd_side_regs,
              "PRODUCER_REGS": cfg.fwd_producer_regs}
else:  # "bwd", or "bwd_fixed": deterministic mode's int64 fixed-point dkv
    fixed = which == "bwd_fixed"
    fn = sparse_attn_bwd_gluon_kernel
    sig = {"q": "*bf16", "kv": "*bf16", "idx": "*i64", "topk_len": "*i32", "sink": "*fp32", "o": "*bf16",
           "do": "*bf16", "lse": "*fp32", "dlse": "*fp32", "dq": "*bf16", "dkv": "*i64" if fixed else "*fp32",
           "dsink_rows": "*fp32", "fx": "*fp32", **{f"stride_{n}": "i64" for n in strides + ("dlt",)},
           "H": "i32", "K": "i32", "scale": "fp32", "n_work": "i32", "n_hb": "i32"}
    consts = {"HAS_LEN": has_len, "HAS_DLSE": True, "BH": 64, "BD": d, "BK": bk, "KEY_REGS": 240,
              "FIXED": fixed}
# what the launcher's specialization sees at run time: 16-aligned pointers and strides
aligned = [k for k, v in sig.items() if v.startswith("*") or k.startswith("stride")]
kernel, ptx, info = build_sm90(fn, sig, consts, aligned)
print(json.dumps({**info,
                  "wgmma_n": re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx),
                  "shared": kernel.metadata.shared, "cp_async": "cp.async" in ptx,
                  "atomics": re.findall(r"(?:atom|red)\.global[.a-z]*\.add[.a-z0-9]*", ptx),
                  "u64_offsets": [int(x) for x in re.findall(r"add\.u64 \[%rd\d+\+(\d+)\]", ptx)],
                  "cvt_s64": len(re.findall(r"cvt\.rni\.s64\.f32", ptx)),
                  "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))}))
"""


def build_sm90(fn, sig: dict, consts: dict, divisible: list[str], gluon: bool = True, num_ctas: int = 1):
    """Gluon kernel ``fn`` (``gluon=False``: a Triton one) compiled for sm_90a (signature ``sig``, constexprs
    ``consts``, the arguments ``divisible`` 16-aligned as the launcher specializes them), then its PTX through
    Triton's ptxas with ``-v``; ``num_ctas``: a cluster's CTAs. Returns ``(kernel, ptx, info)``, ``info``: ptxas's
    exit status, the end of its log and the spill stores. Run inside a build script (:func:`run_build`), not under the
    interpreter."""
    import re
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

    sig = {**sig, **{k: "constexpr" for k in consts}}
    src = ASTSource(fn=fn, signature=sig, attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]]
                                                 for k in divisible},
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_ctas": num_ctas})
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(ptx)
        run = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                             capture_output=True, text=True)
    log = run.stdout + run.stderr
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return kernel, ptx, {"ptxas_rc": run.returncode, "ptxas": log[-2000:],
                         "spill_stores": int(spills[0]) if spills else None}


def run_build(script: str, *args: str) -> dict:
    """Run a build ``script`` (``python -c``) for sm_90 in a fresh process and return the JSON of its last line: the
    suite runs under TRITON_INTERPRET=1, which turns the Gluon library's own jit helpers into interpreter objects
    that the Gluon compiler refuses. Skips where this Triton's Gluon lacks an API the kernel uses."""
    pytest.importorskip("triton.experimental.gluon")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                         timeout=300)
    if "has no attribute" in run.stderr and "gluon" in run.stderr:
        pytest.skip(f"this Triton's Gluon lacks an API the kernel uses: {run.stderr.splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def compile_sm90(which: str, bk: int, d: int, has_len: bool) -> dict:
    """Build sparse-attention kernel ``which`` (``"fwd"``, ``"bwd"`` or ``"bwd_fixed"``) for sm_90 in a fresh
    process (:func:`run_build`)."""
    return run_build(_SCRIPT, which, str(bk), str(d), "1" if has_len else "0")
