"""The frozen FP8 MoE's elementwise kernels (``csattn.ops.moe.triton``) at the slice's 16k shapes (256 experts top-6:
98304 routed rows, I 2048, hidden 4096) over their launch settings: rows a program (``BM``) and warps, the gather-sum
over its token block (``BT``) and column block (``BD``) too. Each setting timed in a CUDA graph with its GB/s, and its
outputs compared bit for bit with the library's launcher (the settings change which program does what, not the
arithmetic: dw's row sums are per 128-column block in either form).

    PYTHONPATH=. python -m lab.probes.moe_launch_sweep
"""

from __future__ import annotations

import itertools

import torch
import triton

from csattn.ops.backend import interpreting
from csattn.ops.fp8.naive import FP8_DTYPE, FP8_MAX
from csattn.ops.moe import triton as moe

LIMIT = 10.0
N, INTER, HIDDEN, K = 98304, 2048, 4096, 6


def timed(name: str, call, nbytes: float) -> float:
    ms = triton.testing.do_bench_cudagraph(call, rep=60)
    print(f"{name:52s} {ms:7.3f} ms {nbytes / ms / 1e6:7.0f} GB/s", flush=True)
    return ms


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = (lambda t: t.view(torch.uint8)) if a.dtype == FP8_DTYPE else (lambda t: t)
    return torch.equal(view(a), view(b))


def rows(cols: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(N, cols, dtype=FP8_DTYPE, device=dev), torch.empty(N, cols // 128, device=dev)


def sweep_fwd(gu: torch.Tensor, w: torch.Tensor) -> None:
    want = rows(INTER, gu.device)
    moe.swiglu_fwd_triton(gu, w, LIMIT, fp8_out=want, keep_h=False)
    for bm, nw in itertools.product((16, 32, 64), (2, 4, 8)):
        q, s = rows(INTER, gu.device)

        def call(q=q, s=s, bm=bm, nw=nw):
            moe._swiglu_fwd_kernel[(triton.cdiv(N, bm), INTER // 128)](
                gu, w, gu, q, s, N, INTER, gu.stride(0), gu.stride(0), q.stride(0), s.stride(0), s.stride(1),
                LIMIT, BM=bm, BN=128, WRITE_H=False, QUANT=True, FP8MAX=FP8_MAX, BY_HAND=interpreting(), num_warps=nw)
        call()
        torch.cuda.synchronize()
        ok = same(q, want[0]) and same(s, want[1])
        timed(f"swiglu fwd quantizing BM {bm:3d} warps {nw} bits {ok}", call, N * INTER * 5 + N * 4)


def sweep_bwd(gu: torch.Tensor, w: torch.Tensor, dh: torch.Tensor) -> None:
    want = rows(2 * INTER, gu.device)
    dw_want = moe.swiglu_bwd_triton(gu, w, dh, LIMIT, fp8_out=want, keep_dgu=False, keep_h=False)[2]
    blocks = INTER // 128
    for bm, nw in itertools.product((8, 16, 32, 64), (2, 4, 8)):
        q, s = rows(2 * INTER, gu.device)
        dwp = torch.empty(N, blocks, device=gu.device)
        dw = torch.empty(N, device=gu.device)

        def call(q=q, s=s, dwp=dwp, dw=dw, bm=bm, nw=nw):
            moe._swiglu_bwd_kernel[(triton.cdiv(N, bm), blocks)](
                gu, w, dh, gu, dh, dwp, q, s, N, INTER, gu.stride(0), dh.stride(0), gu.stride(0), dh.stride(0),
                q.stride(0), s.stride(0), s.stride(1), dwp.stride(0), LIMIT, BM=bm, BN=128, WRITE_DGU=False,
                WRITE_H=False, QUANT=True, FP8MAX=FP8_MAX, BY_HAND=interpreting(), num_warps=nw)
            torch.sum(dwp, dim=1, out=dw)
        call()
        torch.cuda.synchronize()
        ok = same(q, want[0]) and same(s, want[1]) and torch.equal(dw, dw_want)
        timed(f"swiglu bwd quantizing BM {bm:3d} warps {nw} bits {ok}", call, N * INTER * 8 + N * 8)


def sweep_gather_sum(y: torch.Tensor, inv: torch.Tensor) -> None:
    want = moe.gather_sum_triton(y, inv, K)
    t = N // K
    for bt, bd, nw in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8)):
        out = torch.empty(t, HIDDEN, dtype=y.dtype, device=y.device)

        def call(out=out, bt=bt, bd=bd, nw=nw):
            moe._gather_sum_kernel[(triton.cdiv(t, bt), triton.cdiv(HIDDEN, bd))](
                y, inv, out, t, HIDDEN, y.stride(0), out.stride(0), K=K, BT=bt, BD=bd, num_warps=nw)
        call()
        torch.cuda.synchronize()
        timed(f"gather_sum BT {bt:2d} BD {bd:4d} warps {nw} bits {torch.equal(out, want)}", call,
              N * HIDDEN * 2 + t * HIDDEN * 2 + N * 8)


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    gu = (torch.randn(N, 2 * INTER, device=dev, generator=gen) * 3).bfloat16()
    w = torch.rand(N, device=dev, generator=gen)
    dh = torch.randn(N, INTER, device=dev, generator=gen).bfloat16()
    y = torch.randn(N, HIDDEN, device=dev, generator=gen).bfloat16()
    inv = torch.randperm(N, device=dev, generator=gen)
    print(f"== {torch.cuda.get_device_name()}", flush=True)
    sweep_fwd(gu, w)
    sweep_bwd(gu, w, dh)
    sweep_gather_sum(y, inv)


if __name__ == "__main__":
    main()
