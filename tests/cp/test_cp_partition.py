"""Row layouts of the CP partitions and the FLOP balance of the balanced one (no processes needed)."""

from __future__ import annotations

import pytest
import torch

from csattn import AttentionConfig, PackedSeqs
from csattn.cp.partition import flop_imbalance, halo_rows, make_layout, partition_flops, row_flops

SPEC_PACK = [5, 127, 1000, 23, 129, 900, 55, 257, 800, 95, 509, 148]


@pytest.mark.parametrize("partition", ["contiguous", "balanced"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_layout_covers_every_row_once_with_equal_shares(partition, size):
    packed = PackedSeqs.from_lengths([40, 7, 200, 1, 32], padded_lengths=[40, 7, 200, 1, 32 + (-280) % (8 * size)])
    layout = make_layout(packed, partition, size)
    rows = torch.cat([layout.local_rows(r) for r in range(size)])
    assert sorted(rows.tolist()) == list(range(packed.num_rows))
    assert {layout.local_rows(r).numel() for r in range(size)} == {packed.num_rows // size}
    for r in range(size):
        assert (layout.owner(layout.local_rows(r)) == r).all()
        segs = layout.segments(r)
        assert all(b1 < a2 for (_, b1), (a2, _) in zip(segs, segs[1:])), "segments must be sorted and merged"


def test_contiguous_layout_is_megatron_split():
    packed = PackedSeqs.from_lengths([100, 60])
    layout = make_layout(packed, "contiguous", 4)
    assert [layout.segments(r) for r in range(4)] == [[(0, 40)], [(40, 80)], [(80, 120)], [(120, 160)]]


def test_balanced_layout_is_zigzag_on_one_document():
    layout = make_layout(PackedSeqs.from_lengths([4096]), "balanced", 4, chunks_per_rank=2)
    # rank r gets chunks r and 2P-1-r
    assert list(layout.chunk_owner) == [0, 1, 2, 3, 3, 2, 1, 0]


def test_halo_rows():
    base = dict(sliding_window=128)
    assert halo_rows(AttentionConfig(layer_type="sliding", **base)) == 127
    assert halo_rows(AttentionConfig(layer_type="csa", compress_ratio=4, **base)) == 127
    assert halo_rows(AttentionConfig(layer_type="hca", compress_ratio=128, **base)) == 127
    assert halo_rows(AttentionConfig(layer_type="csa", compress_ratio=4, sliding_window=4)) == 7


def test_row_flops_count_visible_entries():
    cfg = AttentionConfig(num_heads=2, head_dim=4, rope_head_dim=2, sliding_window=3, layer_type="csa",
                          compress_ratio=4, index_topk=2, index_n_heads=1, index_head_dim=8, o_groups=2)
    packed = PackedSeqs.from_lengths([13])
    flops = row_flops(packed, cfg)
    pos = torch.arange(13)
    visible = (pos + 1) // 4
    keys = torch.clamp(pos + 1, max=3) + visible.clamp(max=2)
    assert torch.equal(flops, 4 * 2 * 4 * keys + 2 * 1 * 9 * visible)


# The real geometry (H=64, d=512, k=512, W=128, indexer 64 x 128) at 128k tokens.
PACKS_128K = {
    "one_document": [131072],
    "two_halves": [65536, 65536],
    "long_and_short": [100000, 31072],
    "three_long": [90000, 20000, 21072],
    "spec_pack_x32": SPEC_PACK * 32 + [131072 - sum(SPEC_PACK) * 32],
}


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("name", list(PACKS_128K))
def test_balanced_partition_flops_within_10_percent_at_128k(name, size):
    packed = PackedSeqs.from_lengths(PACKS_128K[name])
    for layer_type in ("csa",):
        cfg = AttentionConfig(layer_type=layer_type)
        balanced = flop_imbalance(partition_flops(make_layout(packed, "balanced", size), packed, cfg))
        assert balanced <= 0.10, f"{name}, P={size}: balanced partition is {balanced:.1%} off"
    contiguous = flop_imbalance(partition_flops(make_layout(packed, "contiguous", size), packed,
                                                AttentionConfig()))
    if name == "one_document":
        assert contiguous > 1.0  # what the balanced layout fixes: the last rank does > 2x the first's work


def test_whole_stack_balance_at_128k():
    """Summed over a V4-Flash-like layer mix (CSA + HCA + W), the balanced layout stays within 10%."""
    packed = PackedSeqs.from_lengths([131072])
    cfgs = [AttentionConfig(layer_type="csa"), AttentionConfig(layer_type="hca", compress_ratio=128),
            AttentionConfig(layer_type="sliding", rope_scaling=None, rope_theta=1e4)]
    total = sum(partition_flops(make_layout(packed, "balanced", 4), packed, c) for c in cfgs)
    assert flop_imbalance(total) <= 0.10
