"""``csattn.report.live_tensors``: the storages a forward leaves alive are listed, the freed ones are not."""

import torch

from csattn.report.live_tensors import LiveStorages


def test_lists_what_the_forward_keeps_and_nothing_it_freed():
    w = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(128, 64)
    with LiveStorages() as live:
        h = x @ w  # [128, 32]: not saved (mm saves its inputs, tanh its output)
        y = torch.tanh(h)  # [128, 32]: saved by tanh's backward and returned
        del h
        tmp = torch.ones(1000) * 2  # freed below
        del tmp
        z = (y * 3).sum()
    rows = live.alive({w.untyped_storage().data_ptr(), x.untyped_storage().data_ptr()})
    shapes = sorted(shape for _, shape, _, _ in rows)
    assert (1000,) not in shapes
    assert shapes.count((128, 32)) == 1  # tanh's output, kept for its backward and returned; mm's output freed
    assert () in shapes  # the loss
    assert all(nb > 0 for nb, _, _, _ in rows)
    z.backward()


def test_peak_lists_what_was_alive_at_the_largest_point():
    x = torch.randn(64, 64)
    with LiveStorages(track_peak=True, exclude={x.untyped_storage().data_ptr()}) as live:
        big = torch.ones(8192)  # 32 KiB
        small = x + 1  # 16 KiB: the peak, 48 KiB with `big`
        del big
        after = small * 3  # 16 KiB: 32 KiB alive now
    assert live.peak_bytes == 8192 * 4 + 64 * 64 * 4
    assert sorted(shape for _, shape, _, _ in live.peak_rows) == [(64, 64), (8192,)]
    assert after.shape == (64, 64)
