"""cuBLAS's blockwise FP8 GEMM (``torch._scaled_mm``, 1x128 / 128x128 scales) against the same quantized operands in
fp64, over small and large shapes: which shapes it computes right.   python -m lab.probes.scaled_mm_shapes"""

import itertools

import torch

from csattn.ops.fp8.naive import FP8_DTYPE
from csattn.ops.fp8.triton import quantize_1x128_triton


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in itertools.product([16, 256, 4096], [128, 256, 384, 512, 4096], [128, 256, 384, 512, 2048]):
        q = (torch.randn(n, k, generator=g, device="cuda") * 100).clamp(-448, 448).to(FP8_DTYPE)
        s = (torch.rand(-(-n // 128), -(-k // 128), generator=g, device="cuda") + 0.5) * k ** -0.5 / 100
        x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
        qa, sa = quantize_1x128_triton(x, scale_t=True)
        outs = [torch._scaled_mm(qa, q.t(), scale_a=sa, scale_b=s.t(), out_dtype=torch.bfloat16) for _ in range(2)]
        want = (qa.double() * sa.double().repeat_interleave(128, -1)[:, :k]) @ \
            (q.double() * s.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).T
        err = float((outs[0].double() - want).norm() / want.norm())
        flag = "" if err < 4e-3 and torch.equal(*outs) else "   <-- WRONG"
        print(f"m {m:5d} k {k:5d} n {n:5d}: rel err {err:.2e} same twice {torch.equal(*outs)}{flag}", flush=True)


if __name__ == "__main__":
    main()
