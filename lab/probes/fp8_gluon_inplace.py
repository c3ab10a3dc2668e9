"""The Gluon FP8 kernel's input gradient at the MoE shapes (256 experts top-6, 16k tokens, D 4096, I 2048) with the
producer transposing each weight tile into a second buffer (the default: 4 stages of 48 KB) and over itself
(``INPLACE``, ``csattn.ops.fp8.gluon.inplace_settings()``: 6 stages of 32 KB, so the copies run 5 steps ahead of the
math instead of 3; also 7), at LAG 2 and 3, beside the forward GEMM and bf16 ``grouped_mm``; each INPLACE output
against the default's (fp32 outputs: the same products in the same order, so equal bit for bit); then the
frozen-expert MoE (forward + input gradient) with bf16 experts and FP8 experts both ways.

Why: the transposing input gradient ran 413-495 TFLOP/s against the forward's 700-786; a second transposing
warpgroup did not help (the transposition's issue rate is not the limit) and the lag mattered (316 / 458 / 445 at LAG
1 / 2 / 3): the copies' latency is what the 4-stage ring cannot hide. Run on an H200:
python -m lab.probes.fp8_gluon_inplace"""

import csattn.ops.fp8.gluon as fp8_gluon
from lab.probes.gluon_forms import compare_moe, time_gemms

# 7 stages of 32 KB also fit (224 KB) where LoRA's term is not in the kernel (its buffers take 16 KB more)
VARIANTS = {"INPLACE (6 stages, LAG 2)": fp8_gluon.inplace_settings(),
            "INPLACE (6 stages, LAG 3)": {**fp8_gluon.inplace_settings(), "LAG": 3},
            "INPLACE (7 stages, LAG 3)": {**fp8_gluon.inplace_settings(), "STAGES": 7, "LAG": 3}}


def main() -> None:
    time_gemms(VARIANTS)
    compare_moe(VARIANTS)


if __name__ == "__main__":
    main()
