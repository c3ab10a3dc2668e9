"""The Gluon input gradient (the split transposition, the library's default) over its tile order, transposition lag
(the one-transposer forms': since d9fbd87 the split's producer only copies) and partitions at the slice's 16k tokens
(256 experts top-6): ``GROUP_M`` (row tiles side by side sharing a weight column in L2), ``LAG`` (steps between a
stage's copies and its transposition), and the forms the transposition's cost decided (``SPLIT``: two transposing
warpgroups; ``SIMPLE``: each product waited for before its promotion): with the permutes written out (780aa4a) the
transposers take fewer instructions, so the one-transposer forms, whose math warpgroups have more registers, may win
again. Both GEMMs, each timed in a CUDA graph and its output compared bit for bit with the default's.

    PYTHONPATH=. python -m lab.probes.fp8_dgrad_sweep
"""

from __future__ import annotations

import itertools
from functools import partial

import torch

from csattn.ops.fp8 import quantize_1x128
from csattn.ops.fp8.gluon import grouped_mm_gluon, launch_settings
from lab.probes.gluon_forms import bench, moe_gemms


def main() -> None:
    dev = torch.device("cuda")
    print(f"== {torch.cuda.get_device_name()}; default {launch_settings(True)}", flush=True)
    for name, q, s, offs, m, gen in moe_gemms(dev):
        qa, sa = quantize_1x128(torch.randn(m, q.shape[1], device=dev, generator=gen, dtype=torch.bfloat16))
        base = grouped_mm_gluon(qa, sa, q, s, offs, True)
        flop = 2.0 * m * q.shape[1] * q.shape[2]
        one = launch_settings(True, split=False)  # the one-transposer register split
        # overlapped: a product kept running while the last is promoted needs the forward's 232 registers; with the
        # permutes written out the producer builds at 48 without spills on Triton 3.6 and 3.9 (at 224 / 64: 128 bytes)
        forms = {"split, simple": {}, "one transposer, simple": one,
                 "one transposer, overlapped": {**one, "SIMPLE": False, "MATH_REGS": 232, "PRODUCER_REGS": 48}}
        for (form, extra), group_m, lag in itertools.product(forms.items(), (8, 16), (1, 2, 3)):
            cfg = {**extra, "GROUP_M": group_m, "LAG": lag}
            got = grouped_mm_gluon(qa, sa, q, s, offs, True, settings=cfg)
            torch.cuda.synchronize()
            bench(name, f"{form}: GROUP_M {group_m:2d} LAG {lag} equal {torch.equal(got, base)}",
                  partial(grouped_mm_gluon, qa, sa, q, s, offs, True, settings=cfg), flop)


if __name__ == "__main__":
    main()
