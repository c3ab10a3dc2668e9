"""The Gluon FP8 kernel's input gradient two ways at the MoE shapes (256 experts top-6, 16k tokens, D 4096, I 2048):
the producer transposing each weight tile in shared memory (the default) and ``SWAP`` (``W_e^T dY^T``, the weight's
operand read transposed into registers by ``ldmatrix``, ``csattn.ops.fp8.gluon.SWAP_SETTINGS``; also with the
activation's scales read from global memory; also with 6 stages), beside the
forward GEMM of the same size and bf16 ``grouped_mm``; then the frozen-expert MoE (forward + input gradient) with
bf16 experts and FP8 experts both ways. Each SWAP output against the default's (fp32 outputs: the two sum the
same products in another order). Run on an H200: python -m lab.probes.fp8_gluon_swap"""

import torch

import csattn.ops.fp8.gluon as fp8_gluon
from csattn.ops.fp8 import quantize_1x128
from csattn.ops.fp8.naive import fp8_grouped_mm_quantized
from lab.probes.gluon_forms import compare_moe, time_gemms
from tests.helpers import rel_err

# the scales by TMA (SCALES_TMA) are left out: they fault where a group starts at a row that is not a multiple of 4,
# as every group here but the first may (lab.probes.fp8_swap_fault)
VARIANTS = {"": fp8_gluon.SWAP_SETTINGS, "(6 stages)": {**fp8_gluon.SWAP_SETTINGS, "STAGES": 6}}


def diagnose() -> bool:
    """A small case (2 experts, 256 x 256, 300 rows) against fp64 on the same operands; where SWAP is wrong, which
    columns of the result hold which of the product's (a relabeling gone wrong shows as a permutation) and which rows
    are off. Returns whether it matched."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    q = (torch.randn(2, 256, 256, device=dev, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(2, 2, 2, device=dev, generator=g) * 1e-3 + 1e-3
    offs = torch.tensor([140, 300], dtype=torch.int32, device=dev)
    a = torch.randn(300, 256, device=dev, generator=g).bfloat16()
    qa, sa = quantize_1x128(a)
    ref = fp8_grouped_mm_quantized(qa.double() * sa.double().repeat_interleave(128, dim=-1), q, s, offs, True,
                                   quantize_a=False)
    ok = True
    for name, settings in VARIANTS.items():
        out = fp8_gluon.grouped_mm_gluon(qa, sa, q, s, offs, True, out_dtype=torch.float32,
                                         settings=settings).double()
        err = rel_err(out, ref)
        print(f"SWAP {name} small case vs fp64: {err:.2e} (finite {bool(torch.isfinite(out).all())})")
        if err >= 2.0 ** -12:
            ok = False
            _where(out, ref)
    return ok


def _where(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Which columns of ``out`` hold which of ``ref``'s (the first group's 140 rows), and which rows are off."""
    both = torch.nn.functional.normalize(out[:140], dim=0).T @ torch.nn.functional.normalize(ref[:140], dim=0)
    print("column c of the result is the product's column:", both.argmax(1)[:64].tolist())
    rows = ((out - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30))
    print("rows off by > 1e-3:", torch.nonzero(rows > 1e-3).flatten()[:40].tolist())


def main() -> None:
    if not diagnose():
        print("(SWAP wrong on the small case: the timings below are of a wrong product)")
    forms = {f"SWAP {name}".strip(): settings for name, settings in VARIANTS.items()}
    time_gemms(forms)
    compare_moe({"SWAP": fp8_gluon.SWAP_SETTINGS})


if __name__ == "__main__":
    main()
