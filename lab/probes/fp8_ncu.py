"""One launch each of the Gluon FP8 kernel's forward, its pipeline ceiling (``lab.probes.fp8_gluon_ceiling``, no
promotion) and cuBLAS's blockwise ``_scaled_mm``, for Nsight Compute to profile (the names tell cuBLAS's tile
shape and cluster): the MoE's gate_up forward (256 experts top-6, 16k tokens) and one dense group of
16384 x 4096 x 2048. ``python -m lab.probes.fp8_ncu trans``: only the gate_up input gradient (the kernel's ``TRANS``
form). Run on a GPU of sm_90 under ``ncu`` (lab/ncu_session.sh, lab/ncu_source_session.sh)."""

from __future__ import annotations

import sys

import torch

from benchmarks.providers.fp8 import _quantized
from csattn.ops.fp8 import quantize_1x128
from csattn.ops.fp8.gluon import grouped_mm_gluon
from lab.probes.fp8_gluon_ceiling import ceiling_mm
from lab.probes.gluon_forms import moe_gemms


def main() -> None:
    dev = torch.device("cuda")
    name, q, s, offs, m, gen = next(iter(moe_gemms(dev)))
    if sys.argv[1:] == ["trans"]:
        qa, sa = quantize_1x128(torch.randn(m, q.shape[1], device=dev, generator=gen, dtype=torch.bfloat16))
        grouped_mm_gluon(qa, sa, q, s, offs, True)
        torch.cuda.synchronize()
        return
    qa, sa = quantize_1x128(torch.randn(m, q.shape[2], device=dev, generator=gen, dtype=torch.bfloat16))
    grouped_mm_gluon(qa, sa, q, s, offs, False)
    ceiling_mm(qa, sa, q, offs, 0)
    m, n, k = 16384, 4096, 2048
    q, s = _quantized((1, n, k), dev, gen)
    qa, sa = quantize_1x128(torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16))
    offs = torch.tensor([m], dtype=torch.int32, device=dev)
    grouped_mm_gluon(qa, sa, q, s, offs, False)
    ceiling_mm(qa, sa, q, offs, 0)
    qt, st = quantize_1x128(torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16), scale_t=True)
    torch._scaled_mm(qt, q[0].t(), scale_a=st, scale_b=s[0].t(), out_dtype=torch.bfloat16)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
