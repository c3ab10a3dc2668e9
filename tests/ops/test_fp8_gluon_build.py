"""The Gluon FP8 grouped GEMM builds for sm_90 on any machine (no GPU): TMA copies, FP8 warpgroup MMAs (in the
forward one product left running while the last is promoted, ``wait_group 1``), no register spills at its
register split, and the transposition of the weight tile (``TRANS``) through 4-byte shared loads, byte permutes
and 16-byte shared stores (the forward copies its tiles by TMA only), and the result through shared memory into
16-byte global stores."""

from __future__ import annotations

import json

import pytest
import torch

from csattn.ops.backend import triton_version
from tests.ops.gluon_sm90 import run_build

_SCRIPT = r"""
import json, re, sys
from tests.ops.gluon_sm90 import build_sm90
from csattn.ops.fp8.gluon import fp8_grouped_gluon_kernel as fn, launch_settings, tile_smem

trans, low_rank, split = (a == "1" for a in sys.argv[1:4])
extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}  # settings over the defaults
desc = f"tensordesc<fp8e4nv[128, 128],{tile_smem()!r}>"
ints = ("KC", "E", "W_ROWS", "tiles_m", "tiles_n", "stride_sam", "stride_sak", "stride_swe", "stride_sbk",
        "stride_sbn", "stride_om")
sig = {"a_desc": desc, "w_desc": desc, "sa": "*fp32", "sw": "*fp32", "table": "*i32", "out": "*bf16",
       **{k: "i32" for k in ints}, "v_desc": desc, "lw_desc": desc, "l_scale": "fp32"}
if low_rank:  # the LoRA term at rank 16
    from triton.experimental.gluon import language as gl
    lr = gl.NVMMASharedLayout.get_default_for([128, 16], gl.bfloat16)
    sig["v_desc"] = sig["lw_desc"] = f"tensordesc<bf16[128, 16],{lr!r}>"
settings = {**launch_settings(trans, split), **extra}
if settings["PERMUTED"]:  # the weight's (and LoRA's w) copies with their rows permuted: [4, rows / 4, C] blocks
    from triton.experimental.gluon import language as gl
    from csattn.ops.fp8.gluon_tiles import permuted_tile_smem
    sig["w_desc"] = f"tensordesc<fp8e4nv[4, 32, 128],{permuted_tile_smem()!r}>"
    if low_rank:
        lr3 = gl.NVMMASharedLayout(lr.swizzle_byte_width, 16, rank=3)
        sig["lw_desc"] = f"tensordesc<bf16[4, 32, 16],{lr3!r}>"
# the output's row stride 16-aligned, as the launcher specializes it for the weights' multiples of 128
kernel, ptx, info = build_sm90(fn, sig, dict(TRANS=trans, E_P2=512, LOW_RANK=low_rank, **settings),
                               [k for k, v in sig.items() if v.startswith("*")] + ["stride_om"])
print(json.dumps({**info, "serialized": any(c in info["ptxas"] for c in ("C7514", "C7512", "C7517")),
                  "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)\.f32\.(\w+)\.",
                                                 ptx))),
                  "wait_group": sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx))),
                  "tma": "cp.async.bulk.tensor" in ptx, "loads_b32": len(re.findall(r"ld\.shared\.b32", ptx)),
                  "ldmatrix": len(re.findall(r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16", ptx)),
                  "loads_v4": len(re.findall(r"ld\.shared\.v4", ptx)),
                  "global_stores_b32": len(re.findall(r"st\.global\.b32", ptx)),
                  "global_stores_v4": len(re.findall(r"st\.global\.v4\.b32", ptx)),
                  "stores_v4": len(re.findall(r"st\.shared\.v4", ptx)),
                  "mbarrier_inits": len(re.findall(r"mbarrier\.init", ptx)),
                  "threads": re.findall(r"\.reqntid (\d+)", ptx),
                  "shared": kernel.metadata.shared}))
"""


# the result through shared memory (COALESCED): [64, 128] bf16 a math warpgroup, 16 KB, 128 bytes a thread: eight
# 16-byte shared stores, then eight 16-byte global stores, at two sites (the result, the zero rows past offs[-1]), in
# each of the two math warpgroups
_EPILOGUE = 2 * 2 * 8


def _waits(trans: bool) -> list[str]:
    """The MMA waits of the math loop: one product left running while the last is promoted (``wait_group 1``, and
    0 at a tile's end), or with ``SIMPLE`` (the input gradient's default) each product waited for in full."""
    from csattn.ops.fp8.gluon import launch_settings

    return ["0"] if launch_settings(trans)["SIMPLE"] else ["0", "1"]


@pytest.mark.parametrize("low_rank", [False, True])
@pytest.mark.parametrize("trans", [False, True])
def test_gluon_fp8_grouped_builds_for_sm90(trans, low_rank):
    info = run_build(_SCRIPT, "1" if trans else "0", "1" if low_rank else "0", "0")
    print({k: v for k, v in info.items() if k != "ptxas"})
    assert info["ptxas_rc"] == 0, info["ptxas"]
    assert info["spill_stores"] == 0 and not info["serialized"], info["ptxas"]
    # the low-rank term (LoRA): one bf16 MMA of depth 16 in the epilogue
    mmas = [["m64n128k16", "bf16"], ["m64n128k32", "e4m3"]] if low_rank else [["m64n128k32", "e4m3"]]
    assert info["wgmma"] == mmas and info["wait_group"] == _waits(trans) and info["tma"]
    # the transposition: a stage's weight tile is 16 KB, 128 bytes a producer thread: 32 4-byte loads, 8 16-byte
    # stores, in the loop and again in the drain after it (the forward moves its tiles by TMA only); beside them
    # the epilogue's (_EPILOGUE)
    assert (info["loads_b32"], info["stores_v4"]) == ((64, 16 + _EPILOGUE) if trans else (0, _EPILOGUE))
    assert (info["global_stores_v4"], info["global_stores_b32"]) == (_EPILOGUE, 0)
    assert info["shared"] <= 227 * 1024
    # the ring's barriers (landed, free; ready once transposed where it transposes) and the low-rank term's two
    # pairs: none made and left unused (the allocator would give a dead barrier's bytes to a later buffer)
    assert info["mbarrier_inits"] == 4 * (3 if trans else 2) + (4 if low_rank else 0)


@pytest.mark.parametrize("low_rank", [False, True])
def test_gluon_fp8_input_grad_split_transposition_builds_for_sm90(low_rank):
    """``SPLIT`` (the default): the producer only copies, and two transposing warpgroups take the weight tile's
    halves, two steps a fence (``PAIRED``), on tiles copied by a 3-D TMA with their K rows permuted (``PERMUTED``; and
    LoRA's ``w`` rows likewise), so that the transposers' words are the matrix loads' fragments: 4 ``ldmatrix.x4`` a
    thread a piece and no 4-byte loads; the accumulator's columns put back in the epilogue through shared memory (its
    8 matrix loads a math warpgroup a site where the unpermuted form has 16, beside 16-byte loads). 20 warps, the same
    MMAs, copies and barriers as the one transposer; no spills at ``SPLIT_SETTINGS``' register split (184 / 24 / 56 /
    56), but for one 4-byte value at the kernel's entry on Triton 3.6 (20 warps: 96 registers there, before the
    partitions take theirs)."""
    info = run_build(_SCRIPT, "1", "1" if low_rank else "0", "1")
    print({k: v for k, v in info.items() if k != "ptxas"})
    assert info["ptxas_rc"] == 0, info["ptxas"]
    entry = 4 if triton_version() <= (3, 6) else 0
    assert info["spill_stores"] == entry and not info["serialized"], info["ptxas"]
    mmas = [["m64n128k16", "bf16"], ["m64n128k32", "e4m3"]] if low_rank else [["m64n128k32", "e4m3"]]
    assert info["wgmma"] == mmas and info["wait_group"] == ["0"] and info["tma"]
    assert info["threads"] == ["640"]
    # a transposing warpgroup's sites: two steps a fence, and a tile's last step alone where the steps are odd
    assert (info["loads_b32"], info["ldmatrix"], info["loads_v4"]) == (0, 3 * 2 * 4 + 16, 16)
    assert info["mbarrier_inits"] == 4 * 3 + (4 if low_rank else 0) and info["shared"] <= 227 * 1024


@pytest.mark.parametrize("low_rank", [False, True])
def test_gluon_fp8_input_grad_unpermuted_split_builds_for_sm90(low_rank):
    """The split's forms before ``PAIRED`` and ``PERMUTED`` (measured against the default by
    ``lab/probes/fp8_dgrad_copier.py``): 64 bytes a thread a piece, 16 4-byte loads and 4 16-byte stores in each
    transposing warpgroup's loop (none in the producer); 2 more 16-byte stores are the compiler's setup of five
    partitions. No spills."""
    info = run_build(_SCRIPT, "1", "1" if low_rank else "0", "1", json.dumps({"PERMUTED": False, "PAIRED": False}))
    print({k: v for k, v in info.items() if k != "ptxas"})
    assert info["ptxas_rc"] == 0, info["ptxas"]
    assert info["spill_stores"] == 0 and not info["serialized"], info["ptxas"]
    assert info["threads"] == ["640"] and info["tma"] and info["wait_group"] == ["0"]
    assert (info["loads_b32"], info["stores_v4"]) == (32, 8 + 2 + _EPILOGUE)
    assert info["mbarrier_inits"] == 4 * 3 + (4 if low_rank else 0) and info["shared"] <= 227 * 1024


_WIDE_SCRIPT = r"""
import json, re, sys
from tests.ops.gluon_sm90 import build_sm90
from csattn.ops.fp8.gluon_tiles import tile_smem
from csattn.ops.fp8.gluon_wide import WIDE_SETTINGS, fp8_grouped_gluon_wide_kernel as fn
from triton.experimental.gluon import language as gl

low_rank = sys.argv[1] == "1"
a = f"tensordesc<fp8e4nv[64, 128],{tile_smem()!r}>"
ints = ("KC", "E", "W_ROWS", "tiles_m", "tiles_n", "stride_sam", "stride_sak", "stride_swe", "stride_sbk", "stride_sbn",
        "stride_om")
sig = {"a_desc": a, "w_desc": f"tensordesc<fp8e4nv[256, 128],{tile_smem()!r}>", "sa": "*fp32", "sw": "*fp32",
       "table": "*i32", "out": "*bf16", **{k: "i32" for k in ints}, "v_desc": a, "lw_desc": a, "l_scale": "fp32"}
if low_rank:  # the LoRA term at rank 16: the tile's 64 rows of v, its 256 columns of w
    lr = gl.NVMMASharedLayout.get_default_for([128, 16], gl.bfloat16)
    sig["v_desc"], sig["lw_desc"] = f"tensordesc<bf16[64, 16],{lr!r}>", f"tensordesc<bf16[256, 16],{lr!r}>"
kernel, ptx, info = build_sm90(fn, sig, dict(E_P2=512, LOW_RANK=low_rank, **WIDE_SETTINGS),
                               [k for k, v in sig.items() if v.startswith("*")] + ["stride_om"])
print(json.dumps({**info, "serialized": any(c in info["ptxas"] for c in ("C7514", "C7512", "C7517")),
                  "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)\.f32\.(\w+)\.",
                                                 ptx))),
                  "wait_group": sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx))),
                  "tma": "cp.async.bulk.tensor" in ptx,
                  "global_stores_v4": len(re.findall(r"st\.global\.v4\.b32", ptx)),
                  "global_stores_b32": len(re.findall(r"st\.global\.b32", ptx)),
                  "stores_v4": len(re.findall(r"st\.shared\.v4", ptx)),
                  "mbarrier_inits": len(re.findall(r"mbarrier\.init", ptx)), "shared": kernel.metadata.shared}))
"""


@pytest.mark.parametrize("low_rank", [False, True])
def test_gluon_fp8_wide_forward_builds_for_sm90(low_rank):
    """The forward over ``[64, 256]`` tiles (``gluon_wide``): the kernel's loop (one product left running while the
    last is promoted), FP8 MMAs of ``m64n128k32`` (each math warpgroup a 128-column block of the tile's 64 rows), no
    spills or serialized MMAs at the forward's register split, the result in 16-byte stores through shared memory
    (as :data:`_EPILOGUE`), 4 stages of 40 KB, LoRA's term in 2 x 10 KB."""
    info = run_build(_WIDE_SCRIPT, "1" if low_rank else "0")
    print({k: v for k, v in info.items() if k != "ptxas"})
    assert info["ptxas_rc"] == 0, info["ptxas"]
    assert info["spill_stores"] == 0 and not info["serialized"] and "C75" not in info["ptxas"], info["ptxas"]
    mmas = [["m64n128k16", "bf16"], ["m64n128k32", "e4m3"]] if low_rank else [["m64n128k32", "e4m3"]]
    assert info["wgmma"] == mmas and info["wait_group"] == ["0", "1"] and info["tma"]
    assert (info["global_stores_v4"], info["global_stores_b32"], info["stores_v4"]) == (_EPILOGUE, 0, _EPILOGUE)
    assert 4 * 40 * 1024 <= info["shared"] <= (4 * 40 + 16 + (20 if low_rank else 0) + 1) * 1024
    assert info["mbarrier_inits"] == 4 * 2 + (4 if low_rank else 0)


_TRANSPOSE_SCRIPT = r"""
import json, re
from tests.ops.gluon_sm90 import build_sm90
from csattn.ops.fp8.triton import transpose_codes_kernel as fn

sig = {"src": "*u8", "dst": "*u8", "R": "i32", "C": "i32", "stride_se": "i32", "stride_de": "i32"}
kernel, ptx, info = build_sm90(fn, sig, {"BT": 64}, list(sig), gluon=False)
print(json.dumps({**info, "loads": sorted(set(re.findall(r"ld\.global[.a-z0-9]*", ptx))),
                  "stores": sorted(set(re.findall(r"st\.global[.a-z0-9]*", ptx))),
                  "shared": kernel.metadata.shared}))
"""


def test_transpose_codes_builds_for_sm90():
    """The K-major copy's pass (``triton.transpose_codes_kernel``) at 16-aligned widths (the experts' are multiples
    of 128): global memory read and written in 16-byte accesses only (the tile's rows in both), through 4 KB of
    shared memory, no spills."""
    info = run_build(_TRANSPOSE_SCRIPT)
    print({k: v for k, v in info.items() if k != "ptxas"})
    assert info["ptxas_rc"] == 0 and info["spill_stores"] == 0, info["ptxas"]
    assert info["loads"] == ["ld.global.v4.b32"] and info["stores"] == ["st.global.v4.b32"]
    assert info["shared"] <= 4096


@pytest.mark.parametrize("trans", [False, True])
def test_gluon_settings_refuse_what_the_kernel_has_not(trans):
    """The launcher refuses a setting the kernel has not (the input gradient's removed forms among them), by name,
    before any work (CPU tensors: nothing reaches a device)."""
    pytest.importorskip("triton.experimental.gluon")
    from csattn.ops.fp8.gluon import grouped_mm_gluon

    e, n, k, m = 2, 128, 256, 8
    a = torch.zeros(m, n if trans else k, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"settings: the kernel has no \['SWAP'\]"):
        grouped_mm_gluon(a, torch.ones(m, a.shape[1] // 128), torch.zeros(e, n, k, dtype=torch.float8_e4m3fn),
                         torch.ones(e, n // 128, k // 128), torch.tensor([3, 8], dtype=torch.int32), trans,
                         settings={"SWAP": True, "STAGES": 4})
    # a form of the input gradient's transposition where there is none (the forward), or PAIRED without its
    # transposing warpgroups: its barriers would count the wrong arrivals
    name, form = ("PAIRED", {"PAIRED": True, "SPLIT": False}) if trans else ("SPLIT", {"SPLIT": True})
    with pytest.raises(ValueError, match=f"settings: {name} is a form of the input gradient's transposition"):
        grouped_mm_gluon(a, torch.ones(m, a.shape[1] // 128), torch.zeros(e, n, k, dtype=torch.float8_e4m3fn),
                         torch.ones(e, n // 128, k // 128), torch.tensor([3, 8], dtype=torch.int32), trans,
                         settings=form)
