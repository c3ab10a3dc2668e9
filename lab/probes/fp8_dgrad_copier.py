"""The Gluon input gradient's forms after Nsight Compute's stall sampling of the split transposition on an H100
(1cdfd36, ``lab/results/finetune_h100/ncu_stalls_1cdfd36.txt``): the math warpgroups waited for transposed stages
~45 % of their samples and for their products ~45 %; the transposing warpgroups waited for their copies to land
~33 % (the producer transposed too, so its copies queued behind a transposition) and in the fence and barrier after
their stores ~40 %; 28 % of the kernel's shared wavefronts were bank conflicts of the transposition.

Forms against the default (``SPLIT``: the producer only copies, two transposing warpgroups, two steps a fence
(``PAIRED``), the tiles' rows permuted so that the transposition's loads and stores fall on distinct banks
(``PERMUTED``); 1cdfd36's split, the producer transposing half of each tile, is in git up to ad10675): neither
(``plain``, the default up to f7a33bb), ``paired`` only, ``permuted`` only. Each with LoRA's term, bit for bit; both
GEMMs at the slice's 16k tokens (256 experts top-6), bit for bit and timed; then the frozen MoE.

    PYTHONPATH=. python -m lab.probes.fp8_dgrad_copier
"""

from __future__ import annotations

import torch

from csattn.ops.fp8 import quantize_1x128
from csattn.ops.fp8.gluon import RANK, grouped_mm_gluon, launch_settings
from lab.probes.gluon_forms import compare_moe, moe_gemms, time_gemms

FORMS = {"plain": {"PERMUTED": False, "PAIRED": False}, "paired": {"PERMUTED": False},
         "permuted": {"PAIRED": False}}


def low_rank_equal() -> None:
    """Each form with LoRA's term in the kernel (rank 16) against the default, bit for bit."""
    dev = torch.device("cuda")
    for name, q, s, offs, m, gen in moe_gemms(dev):
        qa, sa = quantize_1x128(torch.randn(m, q.shape[1], device=dev, generator=gen, dtype=torch.bfloat16))
        v = torch.randn(m, RANK, device=dev, generator=gen, dtype=torch.bfloat16)
        w = torch.randn(q.shape[0], q.shape[2], RANK, device=dev, generator=gen, dtype=torch.bfloat16)
        base = grouped_mm_gluon(qa, sa, q, s, offs, True, out_dtype=torch.float32, low_rank=(v, w, 0.5))
        for form, cfg in FORMS.items():
            got = grouped_mm_gluon(qa, sa, q, s, offs, True, out_dtype=torch.float32, low_rank=(v, w, 0.5),
                                   settings=cfg)
            torch.cuda.synchronize()
            print(f"{name:8s} {form} with LoRA's term vs default: equal {torch.equal(got, base)}", flush=True)


def main() -> None:
    print(f"== {torch.cuda.get_device_name()}; default {launch_settings(True)}", flush=True)
    low_rank_equal()
    time_gemms(FORMS)
    for _ in range(2):  # alternating: the card's clocks drift over a run
        compare_moe(FORMS)


if __name__ == "__main__":
    main()
