"""MXFP4 -> FP8 (e4m3, one power-of-two scale per 128 x 128 block) at load: bit for bit the MXFP4 values wherever
e4m3 can hold the block, and every block it cannot hold flagged."""

import pytest
import torch

from csattn.models.deepseek_v4.quant import dequantize_fp8, dequantize_mxfp4, mxfp4_to_fp8

BLOCK = (128, 128)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes ``[..., K]`` (0..15) -> packed bytes ``[..., K/2]`` (low nibble = even column)."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def check_exact(packed, scale):
    q, s, inexact = mxfp4_to_fp8(packed, scale)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and not inexact.any()
    assert torch.equal(torch.exp2(torch.log2(s)), s)  # powers of two
    assert torch.equal(dequantize_fp8(q, s, BLOCK), dequantize_mxfp4(packed, scale))
    return q, s


@pytest.mark.parametrize("span", [8, 14])
def test_exact_over_many_binades(span):
    """One block whose groups' scales lie ``span`` binades apart, each group holding e2m1's smallest (0.5) and
    largest (6) magnitudes: 0.5 * 2**e_min and 6 * 2**e_max fit e4m3 under one power of two up to 14 binades
    (e4m3 spans 2**-9 .. 448)."""
    codes = torch.arange(128 * 128).remainder(16).view(128, 128)  # every code, both signs, in every group
    scale = torch.full((128, 4), 120, dtype=torch.uint8)
    scale[:, 3] = 120 + span
    scale[5, 1] = 120 + span // 2
    q, s = check_exact(pack(codes), scale)
    assert s.item() == 2.0 ** (120 + span - 127 + 1 - 7)  # 6 * 2**e_max lands on 384 (largest e4m3 of c = 3)
    assert q.float().abs().max() == 384 and q.float().abs()[q.float() != 0].min() == 2.0 ** (-9 + 14 - span)


def test_underflow_is_flagged_and_only_small_values_round():
    """15 binades apart: the values with a bit at 2**(e_min - 1) (0.5 and 1.5 times 2**e_min) fall below e4m3's
    2**-9 grid under the block's scale."""
    codes = torch.arange(128 * 64).remainder(16).view(64, 128)
    scale = torch.full((64, 4), 100, dtype=torch.uint8)
    scale[:, 2] = 115
    packed = pack(codes)
    q, s, inexact = mxfp4_to_fp8(packed, scale)
    assert inexact.tolist() == [[True]]
    got, want = dequantize_fp8(q, s, BLOCK), dequantize_mxfp4(packed, scale)
    wrong = got != want
    assert wrong.any()
    # only the small groups' values with a bit at 2**(e_min - 1) (magnitudes 0.5 and 1.5)
    assert set(want[wrong].abs().unique().tolist()) <= {0.5 * 2.0 ** (100 - 127), 1.5 * 2.0 ** (100 - 127)}
    assert torch.equal(got[:, 64:96], want[:, 64:96])  # the large group is exact


def test_nan_scale_byte_and_non_power_of_two_scales_are_refused():
    packed = pack(torch.ones(4, 64, dtype=torch.long))
    scale = torch.full((4, 2), 127, dtype=torch.uint8)
    scale[2, 1] = 255
    with pytest.raises(ValueError, match=r"'w'.*byte 255"):
        mxfp4_to_fp8(packed, scale, "w")
    with pytest.raises(ValueError, match=r"'w'.*byte 255"):
        mxfp4_to_fp8(packed, scale.view(torch.float8_e8m0fnu), "w")
    with pytest.raises(ValueError, match="powers of two"):
        mxfp4_to_fp8(packed, torch.full((4, 2), 0.75), "w")
    with pytest.raises(ValueError, match="needs"):
        mxfp4_to_fp8(packed, scale[:, :1], "w")


@pytest.mark.parametrize("scale_kind", ["u8", "e8m0", "fp32"])
def test_random_blocks_ragged_and_stacked(scale_kind):
    """Random codes, group scales within 2**6 of each other, ragged block edges, a leading expert dimension; one
    block made inexact on purpose is the only one flagged, and every other block is bit for bit."""
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 200, 80), dtype=torch.uint8, generator=g).view(torch.int8)
    scale = torch.randint(118, 125, (3, 200, 5), dtype=torch.uint8, generator=g)
    scale[1, 130:140, 4] = 60  # expert 1, block (1, 1): small groups 2**58 below the others
    stored = {"u8": scale, "e8m0": scale.view(torch.float8_e8m0fnu),
              "fp32": torch.exp2(scale.double() - 127).float()}[scale_kind]
    q, s, inexact = mxfp4_to_fp8(packed, stored)
    assert q.shape == (3, 200, 160) and s.shape == inexact.shape == (3, 2, 2)
    assert inexact.nonzero().tolist() == [[1, 1, 1]]
    got, want = dequantize_fp8(q, s, BLOCK), dequantize_mxfp4(packed, stored)
    ok = torch.ones_like(got, dtype=torch.bool)
    ok[1, 128:, 128:] = False
    assert torch.equal(got[ok], want[ok])
    big = torch.ones(200, dtype=torch.bool)
    big[130:140] = False
    assert torch.equal(got[1, big], want[1, big])  # the large groups of that block are exact
    assert not torch.equal(got[1, 130:140, 128:], want[1, 130:140, 128:])  # the tiny ones underflow (to zero)
    assert got[1, 130:140, 128:].abs().max() == 0
