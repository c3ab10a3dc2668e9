"""Packed metadata: errors name what the caller passed, in-place edits are seen, and ``CaptureSafePackedSeqs``
rejects bad prefix sums when it is built (its capture path stays free of host reads)."""

from __future__ import annotations

import pytest
import torch

from csattn import PackedSeqs
from csattn.capture_safe import CaptureSafePackedSeqs, NoHostSync
from tests.cp_tasks import build_stack


def _validate_error(packed: PackedSeqs, num_rows: int) -> str:
    with pytest.raises(ValueError) as info:
        packed.validate(num_rows, torch.device("cpu"))
    return str(info.value)


def test_errors_name_cu_seqlens_when_only_it_was_passed():
    msg = _validate_error(PackedSeqs(cu_seqlens=torch.tensor([0, 4, 9])), 10)
    assert msg.startswith("cu_seqlens[-1] = 9") and "cu_seqlens_padded" not in msg, msg
    msg = _validate_error(PackedSeqs(cu_seqlens=torch.tensor([0, 5, 3])), 3)
    assert msg.startswith("cu_seqlens must be non-decreasing") and "padded" not in msg, msg
    # and the other way round
    msg = _validate_error(PackedSeqs(cu_seqlens_padded=torch.tensor([1, 4, 9])), 9)
    assert msg.startswith("cu_seqlens_padded must start at 0"), msg
    # both given: each error names its own argument
    msg = _validate_error(PackedSeqs(torch.tensor([0, 4, 9]), torch.tensor([0, 5, 10])), 11)
    assert msg.startswith("cu_seqlens_padded[-1] = 10"), msg


def test_errors_name_megatron_fields():
    class Params:
        cu_seqlens_q = torch.tensor([0, 4, 9])
        cu_seqlens_q_padded = None
        max_seqlen_q = None

    msg = _validate_error(PackedSeqs.coerce(Params()), 12)
    assert msg.startswith("packed.cu_seqlens_q[-1] = 9") and "padded" not in msg, msg
    layer = build_stack(torch.float64, 0, ("sliding",))[0]
    with pytest.raises(ValueError, match=r"^packed\.cu_seqlens_q\[-1\] = 9 must equal the number of rows \(12\)"):
        layer(torch.randn(12, 32, dtype=torch.float64), packed=Params())


def test_in_place_edit_after_use_is_seen():
    layer = build_stack(torch.float64, 0, ("csa",))[0]
    x = torch.randn(40, 32, dtype=torch.float64)
    packed = PackedSeqs.from_lengths([24, 16])
    layer(x, packed=packed)
    assert int(packed.rows().doc[22]) == 0
    packed.cu_seqlens[1] = 20  # documents of 20 and 20 rows (in place: the same tensor objects)
    packed.cu_seqlens_padded[1] = 20
    assert int(packed.rows().doc[22]) == 1  # the layout follows the new values
    fresh = PackedSeqs.from_lengths([20, 20])
    assert torch.equal(layer(x, packed=packed), layer(x, packed=fresh))
    # an in-place edit to invalid values is rejected, not served from the cache of the valid ones
    packed.cu_seqlens_padded[2] = 39
    with pytest.raises(ValueError, match=r"cu_seqlens_padded\[-1\] = 39 must equal the number of rows \(40\)"):
        layer(x, packed=packed)


def test_in_place_edit_of_a_single_prefix_sum_is_seen():
    cu = torch.tensor([0, 20, 40])
    packed = PackedSeqs(cu_seqlens=cu)
    assert packed.compress(4).num_entries == 10
    cu[1] = 10
    assert packed.compress(4).num_entries == 2 + 7
    assert packed.host_max_seqlen() == 30


def test_static_packed_seqs_checks_at_construction():
    cu = torch.tensor([0, 4, 9])
    cases = [
        (dict(cu_seqlens=torch.tensor([0, 4, 12]), num_rows=9, max_seqlen=8), r"cu_seqlens\[-1\] = 12 must equal"),
        (dict(cu_seqlens=torch.tensor([0, 6, 4, 9]), num_rows=9, max_seqlen=9), "cu_seqlens must be non-decreasing"),
        (dict(cu_seqlens=torch.tensor([2, 4, 9]), num_rows=9, max_seqlen=9), "cu_seqlens must start at 0"),
        (dict(cu_seqlens=cu, num_rows=9, max_seqlen=3), r"max_seqlen = 3 is below the longest document \(5\)"),
        (dict(cu_seqlens=cu, cu_seqlens_padded=torch.tensor([0, 3, 9]), num_rows=9, max_seqlen=6),
         "cu_seqlens_padded describes a document shorter than its real length"),
    ]
    for kwargs, phrase in cases:
        with pytest.raises(ValueError, match=phrase) as info:
            CaptureSafePackedSeqs(**kwargs)
        if "cu_seqlens_padded" not in kwargs:
            assert "cu_seqlens_padded" not in str(info.value)  # only cu_seqlens was passed


def test_static_packed_seqs_inside_no_host_sync_reads_nothing():
    cu, cu_pad = torch.tensor([0, 4, 9]), torch.tensor([0, 6, 12])
    checked = CaptureSafePackedSeqs(cu, cu_pad, num_rows=12, max_seqlen=6)  # outside: checked
    layer = build_stack(torch.float64, 0, ("csa",), capture_safe=True)[0]
    x = torch.randn(12, 32, dtype=torch.float64, requires_grad=True)
    layer(x, packed=checked).sum().backward()  # eager warm-up
    with NoHostSync():
        inside = CaptureSafePackedSeqs(cu, cu_pad, num_rows=12, max_seqlen=6)  # the capture stand-in: no check
        layer(x, packed=inside).sum().backward()


@pytest.mark.parametrize("kwargs,match", [
    (dict(lengths=[10.7, 3]), r"lengths\[0\] = 10.7 is not an integer"),
    (dict(lengths=[4, 3.0]), r"lengths\[1\] = 3.0 is not an integer"),
    (dict(lengths=[4, True]), r"lengths\[1\] = True is not an integer"),
    (dict(lengths=torch.tensor([4.0, 3.0])), r"lengths must be a list of ints or a 1-D integer tensor"),
    (dict(lengths=[4, -1]), r"lengths\[1\] = -1 must be >= 0"),
    (dict(lengths=[2**31]), r"lengths sum to 2147483648 tokens, past the int32 range"),
    (dict(lengths=[2**30, 2**30]), r"lengths sum to 2147483648 tokens"),
    (dict(lengths=[4, 3], padded_lengths=[4, 2**31]), r"padded_lengths sum to .* past the int32 range"),
    (dict(lengths=[4, 3], padded_lengths=[4.5, 3]), r"padded_lengths\[0\] = 4.5 is not an integer"),
    (dict(lengths=[4, 3], padded_lengths=[4]), r"padded_lengths has 1 documents but lengths has 2"),
], ids=["float", "integral_float", "bool", "float_tensor", "negative", "past_int32", "sum_past_int32",
        "padded_past_int32", "padded_float", "padded_count"])
def test_from_lengths_refuses_what_would_be_truncated_or_wrap(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PackedSeqs.from_lengths(**kwargs)


def test_from_lengths_takes_integer_tensors_and_numpy_ints():
    import numpy as np

    expected = [0, 4, 7]
    assert PackedSeqs.from_lengths(torch.tensor([4, 3])).cu_seqlens.tolist() == expected
    assert PackedSeqs.from_lengths(np.array([4, 3])).cu_seqlens.tolist() == expected
    assert PackedSeqs.from_lengths([np.int64(4), 3], padded_lengths=[4, 5]).cu_seqlens_padded.tolist() == [0, 4, 9]
    assert PackedSeqs.from_lengths([2**31 - 1]).cu_seqlens.tolist() == [0, 2**31 - 1]
