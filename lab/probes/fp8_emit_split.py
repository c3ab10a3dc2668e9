"""Where the forward that writes the K-major copy (EMIT) loses: the plain forward, the plain forward with EMIT's loop
and registers (SIMPLE, 224 / 64), and EMIT, at the slice's gate_up and down (256 experts top-6, 16k tokens).
Run on a GPU of sm_90: python -m lab.probes.fp8_emit_split"""

from __future__ import annotations

from functools import partial

import torch

from benchmarks.providers.fp8 import GROUPED, _quantized, _routed
from csattn.ops.fp8 import quantize_1x128
from csattn.ops.fp8.gluon import grouped_mm_gluon
from lab.probes.gluon_forms import bench


def main() -> None:
    dev = torch.device("cuda")
    shape = {**GROUPED, "routing": "256x6", "tokens": 16384}
    ids, _, plan, e, _, gen = _routed(shape, dev)
    m = ids.numel()
    for name, n_w, k_w in (("gate_up", 2 * shape["inter"], shape["hidden"]), ("down", shape["hidden"], shape["inter"])):
        q, s = _quantized((e, n_w, k_w), dev, gen)
        qx, sx = quantize_1x128(torch.randn(m, k_w, device=dev, generator=gen, dtype=torch.bfloat16))
        kept = torch.empty((e, k_w, n_w), dtype=q.dtype, device=dev)
        flop = 2.0 * m * n_w * k_w
        run = partial(grouped_mm_gluon, qx, sx, q, s, plan.offs, False)
        bench(name, "forward", run, flop)
        bench(name, "forward, SIMPLE 224 / 64", partial(run, settings=dict(SIMPLE=True, MATH_REGS=224,
                                                                              PRODUCER_REGS=64)), flop)
        bench(name, "forward, 224 / 64", partial(run, settings=dict(MATH_REGS=224, PRODUCER_REGS=64)), flop)
        bench(name, "EMIT", partial(run, transposed=kept), flop)
        bench(name, "EMIT, LAG 3", partial(run, transposed=kept, settings=dict(LAG=3)), flop)
        for stages, lag in ((5, 3), (5, 4), (6, 5)):
            bench(name, f"EMIT, {stages} stages, LAG {lag}", partial(run, transposed=kept,
                                                                     settings=dict(STAGES=stages, LAG=lag)), flop)


if __name__ == "__main__":
    main()
