"""LoRA's Triton kernels for the grouped MoE (the low-rank term added in one pass, the rank-r product with a row
index, the factor gradient) build for sm_90 on any machine (no GPU) without spills, with their tensor-core MMAs:
the CPU suite runs them under the interpreter, which compiles nothing."""

from __future__ import annotations

from tests.ops.gluon_sm90 import run_build

_SCRIPT = r"""
import json, re
from tests.ops.gluon_sm90 import build_sm90
from csattn.ops.fp8.triton import _low_rank_add_kernel
from csattn.ops.moe.lora_triton import _rank_grad_kernel, _rank_in_kernel


def build(fn, sig, consts):
    _, ptx, info = build_sm90(fn, sig, consts, [k for k, v in sig.items() if v.startswith("*")], gluon=False)
    return {"rc": info["ptxas_rc"], "spills": info["spill_stores"],
            "mma": sorted(set(re.findall(r"(?:wgmma\.mma_async|mma)\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))}


i32 = "i32"
out = {
    "add": build(_low_rank_add_kernel, {"out": "*bf16", "v": "*bf16", "w": "*bf16", "offs": "*i32", "M": i32, "N": i32,
                                        "E": i32, "R": i32, "scale": "fp32", "stride_om": i32, "stride_vm": i32,
                                        "stride_we": i32, "stride_wn": i32}, dict(E_P2=512, BM=64, BN=128, BR=16)),
    "rank_in": build(_rank_in_kernel, {"x": "*bf16", "index": "*i64", "w": "*bf16", "offs": "*i32", "out": "*bf16",
                                       "M": i32, "K": i32, "E": i32, "R": i32, "stride_xm": i32, "stride_we": i32,
                                       "stride_wk": i32, "stride_wr": i32, "stride_om": i32},
                     dict(HAS_INDEX=True, E_P2=512, BM=64, BK=128, BR=16)),
    "rank_grad": build(_rank_grad_kernel, {"p": "*bf16", "x": "*bf16", "index": "*i64", "offs": "*i32",
                                           "out": "*fp32", "K": i32, "R": i32, "scale": "fp32", "SPLIT": i32,
                                           "stride_pm": i32, "stride_xm": i32, "stride_os": i32, "stride_oe": i32,
                                           "stride_or": i32, "stride_ok": i32},
                       dict(HAS_INDEX=True, BM=64, BK=128, BR=16)),
}
print(json.dumps(out))
"""


def test_lora_kernels_build_for_sm90():
    info = run_build(_SCRIPT)
    print(info)
    for name, got in info.items():
        assert got["rc"] == 0 and got["spills"] == 0, (name, got)
    # the tensor cores: warpgroup MMAs where the tile has 64 rows, mma.sync for the rank-16-row factor gradient
    assert info["add"]["mma"] == ["m64n128k16"] and info["rank_in"]["mma"] == ["m64n16k16"]
    assert info["rank_grad"]["mma"] == ["m16n8k16"]
