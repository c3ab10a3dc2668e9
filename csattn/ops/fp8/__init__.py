"""FP8 operators for a frozen base held in DeepSeek's FP8 release format (e4m3 weights, 128x128 fp32 block
scales): the 1x128 activation quantizer, a dense linear and the MoE grouped GEMM, forward and input gradient, no
weight gradient. See ``README.md``."""

from __future__ import annotations

from .grouped import (
                      COMPUTES,
                      Fp8Rows,
                      LowRank,
                      add_low_rank,
                      check_compute,
                      fp8_grouped_mm,
                      kernel_compute,
                      takes_fp8_rows,
)
from .linear import fp8_linear, quantize_1x128, quantize_1x128_rows
from .naive import (
                      BLOCK,
                      FP8_DTYPE,
                      FP8_MAX,
                      check_weight,
                      dequantize,
                      fp8_grouped_mm_quantized,
                      fp8_grouped_mm_ref,
                      fp8_linear_quantized,
                      fp8_linear_ref,
                      low_rank_ref,
                      quantize_1x128_ref,
)

__all__ = ["BLOCK", "COMPUTES", "FP8_DTYPE", "FP8_MAX", "Fp8Rows", "LowRank", "add_low_rank", "check_compute",
           "check_weight", "dequantize", "fp8_grouped_mm", "fp8_grouped_mm_quantized", "fp8_grouped_mm_ref",
           "fp8_linear", "fp8_linear_quantized", "fp8_linear_ref", "kernel_compute", "low_rank_ref", "quantize_1x128",
           "quantize_1x128_ref", "quantize_1x128_rows", "takes_fp8_rows"]
