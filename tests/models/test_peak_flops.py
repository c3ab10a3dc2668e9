"""The MFU denominator is defined once (``csattn.models.deepseek_v4.flops``): a user's value, else a known GPU's,
else none."""

from csattn.models.deepseek_v4.flops import PEAK_FLOPS, peak_flops
from csattn.report.model import PEAK_TFLOPS


def test_peak_flops():
    assert peak_flops("cpu") == 0.0
    assert peak_flops("cpu", tflops=100.0) == 100e12
    assert PEAK_TFLOPS * 1e12 == PEAK_FLOPS == 790e12
