"""Where the SWAP input gradient of the Gluon FP8 kernel faults ("illegal instruction" on the H200 at 020a34e: the
small fp32 case matched fp64, the test's ragged case and the MoE-sized GEMM faulted; every call that faulted wrote
bf16, every one that passed fp32). Each case in its own process (a fault ends the CUDA context): the output dtype,
the contraction's steps, the column tiles, empty groups, rows past ``offs[-1]``, one program for every tile, the
scales by TMA or not, the register split and the ring's depth; each against the transposing kernel on the same
operands. Run on an H200: python -m lab.probes.fp8_swap_fault [case]"""

import subprocess
import sys
from unittest import mock

import torch

import csattn.ops.fp8.gluon as fp8_gluon
from csattn.ops.fp8 import quantize_1x128
from tests.helpers import rel_err

# name: (groups' rows, contraction N, output columns K, rows past offs[-1], out dtype, one program, settings)
GLOBAL = fp8_gluon.SWAP_SETTINGS  # the scales by global loads: every case ran (H100, e80df6b)
SWAP = {**GLOBAL, "SCALES_TMA": True}  # the scales by TMA, as SWAP ran at 020a34e: the unaligned cases faulted
CASES = {
    "small_f32": ([140, 160], 256, 256, 0, torch.float32, False, SWAP),
    "small_bf16": ([140, 160], 256, 256, 0, torch.bfloat16, False, SWAP),
    "small_bf16_global": ([140, 160], 256, 256, 0, torch.bfloat16, False, GLOBAL),
    "small_f32_one_program": ([140, 160], 256, 256, 0, torch.float32, True, SWAP),
    # a group starting at a row that is not a multiple of 4: the scales' TMA box then starts off 16 bytes (every
    # group start above is a multiple of 4; the ragged and MoE cases' are not)
    "small_f32_unaligned": ([141, 160], 256, 256, 0, torch.float32, False, SWAP),
    "small_f32_unaligned_global": ([141, 160], 256, 256, 0, torch.float32, False, GLOBAL),
    "nk3_f32": ([140, 160], 384, 256, 0, torch.float32, False, SWAP),
    "k640_f32": ([140, 160], 256, 640, 0, torch.float32, False, SWAP),
    "empty_groups_f32": ([0, 140, 0, 160], 256, 256, 0, torch.float32, False, SWAP),
    "tail_f32": ([140, 160], 256, 256, 77, torch.float32, False, SWAP),
    "many_tiles_f32": ([128 * 140], 256, 256, 0, torch.float32, False, SWAP),
    "ragged_f32": ("ragged", 384, 640, 77, torch.float32, False, SWAP),
    "ragged_f32_global": ("ragged", 384, 640, 77, torch.float32, False, GLOBAL),
    "ragged_bf16": ("ragged", 384, 640, 77, torch.bfloat16, False, SWAP),
    "many_tiles_bf16": ([128 * 140], 256, 256, 0, torch.bfloat16, False, SWAP),
    "ragged_f32_one_program": ("ragged", 384, 640, 77, torch.float32, True, SWAP),
    # other register splits (setmaxnreg) and ring depths: a fault that moves with them is not the math's
    "ragged_bf16_regs216": ("ragged", 384, 640, 77, torch.bfloat16, False, {**SWAP, "MATH_REGS": 216,
                                                                            "PRODUCER_REGS": 56}),
    "ragged_bf16_6_stages": ("ragged", 384, 640, 77, torch.bfloat16, False, {**SWAP, "STAGES": 6}),
}


def run(name: str) -> None:
    rows, n, k, extra, dtype, one, settings = CASES[name]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(4)
    if rows == "ragged":
        counts = torch.randint(0, 301, (16,), generator=g, device=dev)
        counts[0] = counts[8] = 0
    else:
        counts = torch.tensor(rows, device=dev)
    e = counts.numel()
    offs = counts.cumsum(0).to(torch.int32)
    m = int(offs[-1]) + extra
    q = (torch.randn(e, n, k, device=dev, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(e, n // 128, k // 128, device=dev, generator=g) * 1e-3 + 1e-3
    qa, sa = quantize_1x128(torch.randn(m, n, device=dev, generator=g).bfloat16())
    ref = fp8_gluon.grouped_mm_gluon(qa, sa, q, s, offs, True, out_dtype=torch.float32)
    torch.cuda.synchronize()
    with mock.patch.object(fp8_gluon, "sm_count", (lambda d: 1) if one else fp8_gluon.sm_count):
        out = fp8_gluon.grouped_mm_gluon(qa, sa, q, s, offs, True, out_dtype=dtype, settings=settings)
    torch.cuda.synchronize()
    print(f"{name}: ran; vs transposing kernel {rel_err(out.float(), ref):.2e}, finite "
          f"{bool(torch.isfinite(out).all())}", flush=True)


def main() -> None:
    if len(sys.argv) > 1:
        return run(sys.argv[1])
    for name in CASES:
        p = subprocess.run([sys.executable, "-m", "lab.probes.fp8_swap_fault", name], capture_output=True, text=True,
                           timeout=120)
        tail = (p.stdout + p.stderr).strip().splitlines()
        print(tail[-1] if p.returncode == 0 else f"{name}: FAILED rc {p.returncode}: "
              + next((ln for ln in tail if "Error" in ln), tail[-1] if tail else ""), flush=True)


if __name__ == "__main__":
    main()
