"""The Gluon FP8 grouped GEMM builds for sm_90 on any machine (no GPU): TMA copies, FP8 warpgroup MMAs with one
product left running while the last is promoted (``wait_group 1``), no register spills at its register split, and
the transposition of the weight tile (``TRANS``) through 4-byte shared loads, byte permutes and 16-byte shared
stores (the forward reads shared memory by TMA only)."""

from __future__ import annotations

import pytest

from tests.ops.gluon_sm90 import run_build

_SCRIPT = r"""
import json, re, sys
from tests.ops.gluon_sm90 import build_sm90
from csattn.ops.fp8.gluon import fp8_grouped_gluon_kernel as fn, launch_settings, tile_smem

trans, low_rank = sys.argv[1] == "1", sys.argv[2] == "1"
desc = f"tensordesc<fp8e4nv[128, 128],{tile_smem()!r}>"
ints = ("M", "N", "KC", "E", "W_ROWS", "tiles_m", "tiles_n", "stride_sam", "stride_sak", "stride_swe", "stride_sbk",
        "stride_sbn", "stride_om")
sig = {"a_desc": desc, "w_desc": desc, "sa": "*fp32", "sw": "*fp32", "table": "*i32", "out": "*bf16",
       **{k: "i32" for k in ints}, "v_desc": desc, "lw_desc": desc, "l_scale": "fp32"}
if low_rank:  # the LoRA term at rank 16
    from triton.experimental.gluon import language as gl
    lr = gl.NVMMASharedLayout.get_default_for([128, 16], gl.bfloat16)
    sig["v_desc"] = sig["lw_desc"] = f"tensordesc<bf16[128, 16],{lr!r}>"
kernel, ptx, info = build_sm90(fn, sig, dict(TRANS=trans, E_P2=512, LOW_RANK=low_rank, **launch_settings(trans)),
                               [k for k, v in sig.items() if v.startswith("*")])
print(json.dumps({**info, "serialized": any(c in info["ptxas"] for c in ("C7514", "C7512", "C7517")),
                  "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)\.f32\.(\w+)\.",
                                                 ptx))),
                  "wait_group": sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx))),
                  "tma": "cp.async.bulk.tensor" in ptx, "loads_b32": len(re.findall(r"ld\.shared\.b32", ptx)),
                  "stores_v4": len(re.findall(r"st\.shared\.v4", ptx)),
                  "shared": kernel.metadata.shared}))
"""


@pytest.mark.parametrize("low_rank", [False, True])
@pytest.mark.parametrize("trans", [False, True])
def test_gluon_fp8_grouped_builds_for_sm90(trans, low_rank):
    info = run_build(_SCRIPT, "1" if trans else "0", "1" if low_rank else "0")
    print({k: v for k, v in info.items() if k != "ptxas"})
    assert info["ptxas_rc"] == 0, info["ptxas"]
    assert info["spill_stores"] == 0 and not info["serialized"], info["ptxas"]
    # the low-rank term (LoRA): one bf16 MMA of depth 16 in the epilogue
    mmas = [["m64n128k16", "bf16"], ["m64n128k32", "e4m3"]] if low_rank else [["m64n128k32", "e4m3"]]
    assert info["wgmma"] == mmas and info["wait_group"] == ["0", "1"] and info["tma"]
    # the transposition: a stage's weight tile is 16 KB, 128 bytes a producer thread: 32 4-byte loads, 8 16-byte
    # stores, in the loop and again in the drain after it (the forward moves its tiles by TMA only)
    assert (info["loads_b32"], info["stores_v4"]) == ((64, 16) if trans else (0, 0))
    assert info["shared"] <= 227 * 1024
