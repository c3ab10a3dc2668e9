"""The Gluon input gradient with the weight tile's transposition split over two warpgroups (``gluon.SPLIT_SETTINGS``,
the default since 2dea5ed's measurement: the producer transposes each tile's first 64 columns, a fourth warpgroup the
last 64) against the one transposer: bit for bit and timed (CUDA graphs) at the slice's 16k tokens (~384 rows an
expert), then the frozen MoE each way. Measured on an H100 at 2dea5ed: ``lab/results/finetune_h100/
{xpose2,moe_split}_2dea5ed.txt``.

Why: there the input gradients run at bf16's speed, bound by the producer's transposition (``csattn/ops/fp8/
README.md``: the producer storing zeros and loading nothing ran 682 / 646 TFLOP/s, the kernel 526 / 535). With
``SIMPLE`` the math warpgroups build without spills at 168 registers, which leaves room for a second transposing
warpgroup (a transposer of its own beside 224-register math warpgroups, 316d37a, spilled).

    PYTHONPATH=. python -m lab.probes.fp8_gluon_xpose2        # sm_90
"""

from __future__ import annotations

from functools import partial

import torch

from csattn.ops.fp8 import quantize_1x128
from csattn.ops.fp8.gluon import grouped_mm_gluon, launch_settings
from lab.probes.gluon_forms import bench, compare_moe, moe_gemms


def main() -> None:
    dev = torch.device("cuda")
    one, two = launch_settings(True, split=False), launch_settings(True, split=True)
    forms = {"one transposer": one, "two transposers": two,
             "two transposers, math 168": {**two, "MATH_REGS": 168, "PRODUCER_REGS": 88, "XPOSE_REGS": 88}}
    for name, q, s, offs, m, gen in moe_gemms(dev):
        qa, sa = quantize_1x128(torch.randn(m, q.shape[1], device=dev, generator=gen, dtype=torch.bfloat16))
        base = grouped_mm_gluon(qa, sa, q, s, offs, True, settings=one)
        flop = 2.0 * m * q.shape[1] * q.shape[2]
        for form, settings in forms.items():
            got = grouped_mm_gluon(qa, sa, q, s, offs, True, settings=settings)
            torch.cuda.synchronize()
            print(f"{name:16s} {form}: equal to the one transposer: {torch.equal(got, base)}", flush=True)
            bench(name, f"input gradient, {form}", partial(grouped_mm_gluon, qa, sa, q, s, offs, True,
                                                           settings=settings), flop)
    compare_moe({"one transposer": one})  # the default: two


if __name__ == "__main__":
    main()
