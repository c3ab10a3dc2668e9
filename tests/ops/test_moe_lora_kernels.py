"""The Triton kernels of LoRA's rank-r products over expert-sorted rows (csattn/ops/moe/lora_triton.py) under the
CPU interpreter, against fp64 loops over the groups: the rank-in product with and without a row index (rows past
``offs[-1]`` zero), the factor gradient in both layouts (empty groups zero), ranks that are not powers of two.
Through the MoE op they are held to the fp64 reference by tests/ops/test_moe_lora.py (backend "triton")."""

from __future__ import annotations

import pytest
import torch

from csattn.ops.moe.lora_triton import rank_grad_triton, rank_in_triton

CASES = [([5, 0, 17, 3], 0), ([1, 0, 0], 2), ([0, 33], 0), ([2, 9, 0, 1, 6], 3)]  # rows per group, rows past


def _groups(counts):
    lo = 0
    for c in counts:
        yield lo, lo + c
        lo += c


@pytest.mark.parametrize("counts,tail", CASES)
@pytest.mark.parametrize("rank", [4, 16, 20])
@pytest.mark.parametrize("gather", [False, True])
def test_rank_in_vs_fp64(counts, tail, rank, gather, assert_close):
    g = torch.Generator().manual_seed(len(counts) + rank)
    e, m, k = len(counts), sum(counts) + tail, 72
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    src = torch.randn(m + 7 if gather else m, k, generator=g, dtype=torch.float64)
    index = torch.randint(0, src.shape[0], (m,), generator=g) if gather else None
    rows = src[index] if gather else src
    w = torch.randn(e, rank, k, generator=g, dtype=torch.float64).transpose(1, 2)  # [E, K, r], a strided view
    got = rank_in_triton(src.float(), w.float(), offs, index)
    want = torch.zeros(m, rank, dtype=torch.float64)
    for i, (lo, hi) in enumerate(_groups(counts)):
        want[lo:hi] = rows[lo:hi] @ w[i]
    assert got.dtype == torch.float32 and got.shape == (m, rank)
    assert_close(got, want, 1e-6, "rank in")
    assert (got[sum(counts):] == 0).all()


@pytest.mark.parametrize("counts,tail", CASES)
@pytest.mark.parametrize("rank", [4, 20])
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("split", [1, 3])  # 3: each group's rows in three parts, summed after
def test_rank_grad_vs_fp64(counts, tail, rank, gather, transpose, split, assert_close):
    g = torch.Generator().manual_seed(3 * len(counts) + rank)
    e, m, k = len(counts), sum(counts) + tail, 40
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    p = torch.randn(m, rank, generator=g, dtype=torch.float64)
    src = torch.randn(m + 5 if gather else m, k, generator=g, dtype=torch.float64)
    index = torch.randint(0, src.shape[0], (m,), generator=g) if gather else None
    rows = src[index] if gather else src
    got = rank_grad_triton(p.float(), src.float(), offs, 0.5, index, transpose=transpose, split=split)
    want = torch.zeros(e, rank, k, dtype=torch.float64)
    for i, (lo, hi) in enumerate(_groups(counts)):
        want[i] = 0.5 * p[lo:hi].T @ rows[lo:hi]
    if transpose:
        want = want.transpose(1, 2)
    assert got.shape == want.shape and got.is_contiguous()
    assert_close(got, want, 1e-6, "rank grad")
    for i, c in enumerate(counts):
        if c == 0:
            assert (got[i] == 0).all()
