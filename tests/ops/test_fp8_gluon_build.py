"""The Gluon FP8 grouped GEMM builds for sm_90 on any machine (no GPU): TMA copies, FP8 warpgroup MMAs (in the
forward one product left running while the last is promoted, ``wait_group 1``), no register spills at its
register split, and the transposition of the weight tile (``TRANS``) through 4-byte shared loads, byte permutes
and 16-byte shared stores (the forward copies its tiles by TMA only), and the result through shared memory into
16-byte global stores."""

from __future__ import annotations

import pytest
import torch

from tests.ops.gluon_sm90 import run_build

_SCRIPT = r"""
import json, re, sys
from tests.ops.gluon_sm90 import build_sm90
from csattn.ops.fp8.gluon import (SWAP_SETTINGS, fp8_grouped_gluon_kernel as fn, inplace_settings,
                                 launch_settings, tile_smem)

trans, low_rank, swap, scales_tma = (a == "1" for a in sys.argv[1:5])
inplace = len(sys.argv) > 5 and sys.argv[5] == "1"
desc = f"tensordesc<fp8e4nv[128, 128],{tile_smem()!r}>"
ints = ("M", "N", "KC", "E", "W_ROWS", "tiles_m", "tiles_n", "stride_sam", "stride_sak", "stride_swe", "stride_sbk",
        "stride_sbn", "stride_om")
sig = {"a_desc": desc, "w_desc": desc, "sa": "*fp32", "sw": "*fp32", "table": "*i32", "out": "*bf16",
       **{k: "i32" for k in ints}, "v_desc": desc, "lw_desc": desc, "l_scale": "fp32", "sa_desc": desc}
if scales_tma:  # SWAP's activation scales copied with each stage: [1, 128] fp32 boxes
    from triton.experimental.gluon import language as gl
    plain = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    sig["sa_desc"] = f"tensordesc<fp32[1, 128],{plain!r}>"
if low_rank:  # the LoRA term at rank 16
    from triton.experimental.gluon import language as gl
    lr = gl.NVMMASharedLayout.get_default_for([128, 16], gl.bfloat16)
    sig["v_desc"] = sig["lw_desc"] = f"tensordesc<bf16[128, 16],{lr!r}>"
settings = {**launch_settings(trans), **(SWAP_SETTINGS if swap else {}), **(inplace_settings() if inplace else {}),
            "SCALES_TMA": scales_tma}
# the output's row stride 16-aligned, as the launcher specializes it for the weights' multiples of 128
kernel, ptx, info = build_sm90(fn, sig, dict(TRANS=trans, E_P2=512, LOW_RANK=low_rank, **settings),
                               [k for k, v in sig.items() if v.startswith("*")] + ["stride_om"])
def in_flight_writes(ptx):
    # writes to a register-A operand of an MMA after its start, before a wait (in the PTX's order, which
    # overestimates the paths that reach them): the MMA reads those registers until its wait
    lines, hits = ptx.splitlines(), 0
    for i, line in enumerate(lines):
        m = re.search(r"wgmma\.mma_async.*\}, \{([^}]*)\}, %rd", line)
        if m:
            regs = {r.strip() for r in m.group(1).split(",")}
            for later in lines[i + 1:]:
                if "wgmma.wait_group" in later:
                    break
                w = re.match(r"\s*(?:@%p\d+\s+)?[a-z][\w.]*\s+(%r\d+)", later)
                hits += bool(w and w.group(1) in regs)
    return hits


print(json.dumps({**info, "serialized": any(c in info["ptxas"] for c in ("C7514", "C7512", "C7517")),
                  "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)\.f32\.(\w+)\.",
                                                 ptx))),
                  "wait_group": sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx))),
                  "tma": "cp.async.bulk.tensor" in ptx, "loads_b32": len(re.findall(r"ld\.shared\.b32", ptx)),
                  "in_flight_writes": in_flight_writes(ptx),
                  "a_in_registers": len(re.findall(r"wgmma\.mma_async[^{]*\{[^}]*\}, \{[^}]*\}, %rd", ptx)),
                  "ldmatrix_trans": len(re.findall(r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16", ptx)),
                  "loads_b8": len(re.findall(r"ld\.shared\.(?:b8|u8)", ptx)),
                  "global_stores_b32": len(re.findall(r"st\.global\.b32", ptx)),
                  "global_stores_v4": len(re.findall(r"st\.global\.v4\.b32", ptx)),
                  "shared_loads_v2": len(re.findall(r"ld\.shared\.v2\.(?:b32|f32)", ptx)),
                  "stores_v4": len(re.findall(r"st\.shared\.v4", ptx)),
                  "mbarrier_inits": len(re.findall(r"mbarrier\.init", ptx)),
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
    info = run_build(_SCRIPT, "1" if trans else "0", "1" if low_rank else "0", "0", "0")
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
def test_gluon_fp8_input_gradient_inplace_builds_for_sm90(low_rank):
    """``INPLACE``: the producer transposes each weight tile over itself (both 64-column pieces read, then written:
    the same 32 4-byte loads and 8 16-byte stores a thread as into a second buffer), so the ring has no transposed
    buffers and :func:`inplace_settings`' 6 stages take the 192 KB that 4 took. No spills at its register split on
    Triton 3.6 (the H200's, with torch 2.11); later Triton spills the producer's tile (it needs 232 registers for
    the math warpgroups), which the form's settings say."""
    from csattn.ops.backend import triton_version
    from csattn.ops.fp8.gluon import inplace_settings

    info = run_build(_SCRIPT, "1", "1" if low_rank else "0", "0", "0", "1")
    print({k: v for k, v in info.items() if k != "ptxas"})
    assert info["ptxas_rc"] == 0, info["ptxas"]
    assert not info["serialized"] and "C75" not in info["ptxas"], info["ptxas"]
    assert info["spill_stores"] == 0 or triton_version() > (3, 6), info["ptxas"]
    mmas = [["m64n128k16", "bf16"], ["m64n128k32", "e4m3"]] if low_rank else [["m64n128k32", "e4m3"]]
    assert info["wgmma"] == mmas and info["wait_group"] == _waits(True) and info["tma"]
    assert (info["loads_b32"], info["stores_v4"]) == (64, 16 + _EPILOGUE)
    stages = inplace_settings()["STAGES"]
    # the stages, the low-rank term's buffers, the epilogue's 8 KB a math warpgroup
    assert stages * 32 * 1024 <= info["shared"] <= (stages * 32 + (16 if low_rank else 0) + 16 + 1) * 1024
    assert info["mbarrier_inits"] == 3 * stages + (4 if low_rank else 0)


@pytest.mark.parametrize("scales_tma,low_rank", [(True, False), (False, False), (True, True)])
def test_gluon_fp8_input_gradient_swap_builds_for_sm90(scales_tma, low_rank):
    """``SWAP``: the input gradient as ``W_e^T dY^T`` with the weight's operand in registers. No transposition in
    shared memory (no 4-byte loads or 16-byte stores of it): each math warpgroup reads its 64 columns of a stage's
    weight tile by ``ldmatrix.trans`` on 16-bit pairs (16 bytes a thread an instruction: 4 a 128-deep step, at two
    sites: the tile's first step and the next step's inside the loop) and sorts the bytes in registers; its FP8 MMAs
    take ``A`` from registers; the result leaves in 4-byte stores (two adjacent columns a thread); no spills at
    :data:`SWAP_SETTINGS`'s register split; the activation's scales by TMA with each stage (``SCALES_TMA``: 16
    8-byte shared loads a step) or by 32 loads from global memory; with LoRA's term (transposed) starting the
    accumulator."""
    info = run_build(_SCRIPT, "1", "1" if low_rank else "0", "1", "1" if scales_tma else "0")
    print({k: v for k, v in info.items() if k != "ptxas"})
    assert info["ptxas_rc"] == 0, info["ptxas"]
    assert info["spill_stores"] == 0 and not info["serialized"] and "C75" not in info["ptxas"], info["ptxas"]
    # with LoRA's term: its bf16 MMA of depth 16 starts the accumulator (operands in shared memory)
    mmas = [["m64n128k16", "bf16"], ["m64n128k32", "e4m3"]] if low_rank else [["m64n128k32", "e4m3"]]
    assert info["wgmma"] == mmas and info["wait_group"] == ["0"] and info["tma"]
    # two math warpgroups x 4 MMAs of depth 32 a step (one site); ldmatrix at two sites
    assert info["a_in_registers"] == 8 and info["ldmatrix_trans"] == 16
    # the next step's operand is read while a product runs: never into the registers that product reads
    assert info["in_flight_writes"] == 0
    assert (info["loads_b32"], info["stores_v4"], info["loads_b8"]) == (0, 0, 1)  # the one byte: as the forward
    # 64 columns x 128 rows of bf16 a math warpgroup: 32 4-byte stores a thread, at two sites (result, zero rows)
    assert info["global_stores_b32"] == 2 * 2 * 32
    assert info["shared"] <= (176 if low_rank else 160) * 1024  # no transposed buffers: 4 stages of two 16 KB tiles
    # the scales: two math warpgroups x 16 pairs a step, from shared memory with the stage
    assert info["shared_loads_v2"] == (32 if scales_tma else 0)
    # no "ready" barriers (nothing to wait for without a transposition): a dead barrier's bytes went to the scales'
    # TMA copies, which then wrote over an initialized barrier
    assert info["mbarrier_inits"] == 4 * 2 + (4 if low_rank else 0)


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


@pytest.mark.parametrize("trans,settings,name", [
    (False, {"SWAP": True}, "SWAP"),  # SWAP is the input gradient's form
    (True, {"SCALES_TMA": True}, "SWAP"),  # a setting of SWAP's alone
    (False, {"INPLACE": True}, "INPLACE"),  # the transposing input gradient's form
    (True, {"INPLACE": True, "SWAP": True}, "INPLACE"),  # SWAP transposes nothing
])
def test_gluon_settings_refuse_forms_outside_theirs(trans, settings, name):
    """The launcher refuses ``SWAP`` / ``SCALES_TMA`` / ``INPLACE`` where the kernel has no such form, by name,
    before any work (CPU tensors: nothing reaches a device)."""
    pytest.importorskip("triton.experimental.gluon")
    from csattn.ops.fp8.gluon import grouped_mm_gluon

    e, n, k, m = 2, 128, 256, 8
    a = torch.zeros(m, n if trans else k, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=f"settings: {name}"):
        grouped_mm_gluon(a, torch.ones(m, a.shape[1] // 128), torch.zeros(e, n, k, dtype=torch.float8_e4m3fn),
                         torch.ones(e, n // 128, k // 128), torch.tensor([3, 8], dtype=torch.int32), trans,
                         settings=settings)


def test_swap_operand_columns_are_the_kernels_relabeling():
    """The launcher orders the low-rank term's ``w`` rows by ``operand_columns()`` (a closed form); the kernel
    relabels its operand and accumulator rows by ``_swap_rows`` (a reshape into the row's bits and a permutation of
    them). The two agree (the kernel's reshape / permute done by torch on the column index); a thread's rows ``i`` and
    ``i + 8`` are adjacent columns; each column once."""
    pytest.importorskip("triton.experimental.gluon")
    from csattn.ops.fp8.gluon_swap import operand_columns

    kernel = torch.arange(64).reshape(2, 2, 2, 2, 2, 2).permute(0, 1, 5, 2, 3, 4).reshape(64)
    assert operand_columns() == kernel.tolist()
    assert sorted(operand_columns()) == list(range(64))
    assert all(operand_columns()[i + 8] == operand_columns()[i] + 1 for i in range(64) if not i & 8)
