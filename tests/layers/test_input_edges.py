"""Input the layer used to fail on deep inside: a dtype other than the layer's gets a ValueError that says
what to cast, input without rows (an empty pack) gives output without rows, and ``csattn demo`` refuses an
empty document by naming ``--lengths``."""

import pytest
import torch

from csattn import PackedSeqs
from tests.helpers import random_layer, tiny_config

LAYER_TYPES = ["sliding", "csa", "hca"]


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_dtype_mismatch_names_both_dtypes(layer_type):
    layer = random_layer(tiny_config(layer_type), dtype=torch.float32)
    for dtype in (torch.float64, torch.bfloat16):
        with pytest.raises(ValueError, match=rf"hidden_states is {dtype} but the layer's weights are torch.float32: "
                                             r"cast the input \(hidden_states.to\(torch.float32\)\)"):
            layer(torch.randn(10, 32, dtype=dtype))


@pytest.mark.parametrize("capture_safe", [False, True], ids=["default", "capture_safe"])
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_input_without_rows_gives_output_without_rows(layer_type, capture_safe):
    layer = random_layer(tiny_config(layer_type, capture_safe=capture_safe), dtype=torch.float64)
    for shape, packed in [((0, 32), None), ((0, 32), PackedSeqs.from_lengths([])), ((0, 8, 32), None),
                          ((3, 0, 32), None)]:
        x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        y = layer(x, packed=packed)
        assert y.shape == shape and y.dtype == x.dtype
        y.sum().backward()  # a backward through an empty batch runs too
        assert x.grad.shape == shape
        assert layer.last_indexer_loss is None


def test_input_without_rows_checks_the_pack_and_the_input():
    layer = random_layer(tiny_config("csa"), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"hidden_states has no rows but packed describes 7"):
        layer(torch.randn(0, 32, dtype=torch.float64), packed=PackedSeqs.from_lengths([7]))
    with pytest.raises(ValueError, match="hidden_states has hidden size 31"):
        layer(torch.randn(0, 31, dtype=torch.float64))
    with pytest.raises(ValueError, match="hidden_states is torch.float32"):
        layer(torch.randn(0, 32))


def test_demo_refuses_an_empty_document(capsys):
    from csattn.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["demo", "--only", "stack", "--lengths", "5", "0"])
    assert exc.value.code == 2
    assert "argument --lengths: every document length must be >= 1, got 0" in capsys.readouterr().err
