"""Matrix-multiply FLOPs of one attention layer, or one DeepSeek-V4 training or fine-tuning step, on a packed batch
(the numerator of reported TFLOP/s and MFU), and the peak FLOP/s of a GPU (the denominator of MFU).

Counted from the configs alone (no model is built), here below the planner (``csattn.parallel.plan``), the
trainer and ``csattn report``, which all report them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...config import AttentionConfig
from .config import DeepseekV4ModelConfig

__all__ = ["PEAK_FLOPS", "finetune_flops", "layer_flops", "model_flops", "peak_flops"]

# Dense bf16 matmul FLOP/s measured on an H100 / H200 (BENCHMARKS.md): the MFU denominator of every report.
PEAK_FLOPS = 790e12
_KNOWN_GPUS = ("H100", "H200")


def peak_flops(device: torch.device | str | None = None, tflops: float = 0.0) -> float:
    """FLOP/s of one GPU for the MFU figure: ``tflops`` (a user's ``--peak-tflops``) if given, else
    :data:`PEAK_FLOPS` on a known GPU (H100 / H200), else 0 (no MFU shown). ``device`` None: the current CUDA
    device, if any."""
    if tflops:
        return tflops * 1e12
    if device is None:
        if not torch.cuda.is_available():
            return 0.0
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda" and any(name in torch.cuda.get_device_name(device) for name in _KNOWN_GPUS):
        return PEAK_FLOPS
    return 0.0


def _sum_min(length: int, w: int) -> int:
    """``sum_{j=1..length} min(j, w)``: the window keys of a document's rows (closed form, no per-row loop)."""
    if length <= w:
        return length * (length + 1) // 2
    return w * (w + 1) // 2 + (length - w) * w


def _sum_div(length: int, r: int, cap: int | None = None) -> int:
    """``sum_{j=1..length} min(j // r, cap)``: the complete compressed entries each row sees (capped at ``cap``)."""
    q, rem = divmod(length, r)
    if cap is None or q <= cap:
        return r * q * (q - 1) // 2 + q * (rem + 1)
    return r * cap * (cap - 1) // 2 + cap * (length - cap * r + 1)


def layer_flops(cfg: AttentionConfig, lengths: list[int]) -> dict[str, float]:
    """``{"fwd": ..., "bwd": ...}`` for documents of ``lengths`` real tokens.

    Counts the projections, the compressors, the indexer scores over every visible entry and the sparse
    attention over the attended keys (``4 * H * d`` per key and row). Backward is 2x the forward for the
    matrix products and 2.5x for attention (score recomputation).
    """
    T = sum(lengths)
    D, H, d = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    ql, ol, g = cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups
    proj = 2.0 * T * (D * ql + ql * H * d + D * d + H * d * ol + g * ol * D)
    keys = float(sum(_sum_min(L, cfg.sliding_window) for L in lengths))
    scores = 0.0
    if cfg.layer_type == "csa":
        r, HI, cI = cfg.compress_ratio, cfg.index_n_heads, cfg.index_head_dim
        proj += 2.0 * T * (2 * D * 2 * d + ql * HI * cI + D * HI + 2 * D * 2 * cI)
        scores = 2.0 * HI * cI * sum(_sum_div(L, r) for L in lengths)
        keys += sum(_sum_div(L, r, cap=cfg.index_topk) for L in lengths)
    elif cfg.layer_type == "hca":
        proj += 2.0 * T * 2 * D * d
        keys += sum(_sum_div(L, cfg.compress_ratio) for L in lengths)
    attn = 4.0 * H * d * keys
    return {"fwd": proj + scores + attn, "bwd": 2 * proj + 2 * scores + 2.5 * attn}


def model_flops(config: DeepseekV4ModelConfig, cu_seqlens: Tensor | Sequence[int]) -> dict[str, float]:
    """Matrix-multiply FLOPs of one training step of a DeepSeek-V4 model (``DeepseekV4ModelConfig``) on a
    packed stream whose documents hold ``cu_seqlens`` real tokens (the numerator of the model's MFU).

    Counted, on real tokens only (padding rows are work, not useful work):

    - every attention layer (decoder and MTP blocks) as :func:`layer_flops`: projections, compressors, the
      indexer scores over every visible entry, sparse attention over the keys each row really sees;
    - each mHC site's mixing projection ``[T, n*D] x [n*D, (2+n)*n]``, the final hyper-heads ``[n*D] x [n]``;
    - the MoE: router ``D x E``, ``k`` routed experts and the shared expert (``3 * D * I`` each);
    - the LM head ``D x V`` once per head (the decoder's and each MTP block's), MTP's ``e_proj`` on ``[T, D]``
      and ``h_proj`` on every stream ``[T, n, D]``.

    Not counted: elementwise work (norms, SwiGLU, Sinkhorn, softmax), the indexer loss, embeddings, and any
    recomputation (``recompute`` choices cost time, not useful FLOPs). Backward = 2x the matrix products
    (attention 2.5x, see :func:`layer_flops`).

    Args:
        config: a ``DeepseekV4ModelConfig``.
        cu_seqlens: ``[B + 1]`` cumulative real lengths (tensor or list).
    Returns:
        ``{"fwd": ..., "bwd": ...}``.
    """
    cu = [int(v) for v in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens)]
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:]) if b > a]
    T = float(sum(lengths))
    c = config
    D, n, E, k, I = c.hidden_size, c.hc_mult, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size
    fwd = bwd = 0.0
    blocks = list(range(c.num_hidden_layers)) + [c.num_hidden_layers + j for j in range(c.num_nextn_predict_layers)]
    dense = 0.0
    for i in blocks:
        attn = layer_flops(c.attention_config(i), lengths)
        fwd, bwd = fwd + attn["fwd"], bwd + attn["bwd"]
        dense += 2 * 2.0 * T * n * D * (2 + n) * n  # two mHC sites
        dense += 2.0 * T * D * E + 2.0 * T * (k + 1) * 3 * D * I  # router, routed + shared experts
    heads = 1 + c.num_nextn_predict_layers
    dense += heads * (2.0 * T * n * D * n + 2.0 * T * D * c.vocab_size)  # hyper-heads and LM heads
    dense += c.num_nextn_predict_layers * (2.0 * T * D * D + 2.0 * T * n * D * D)  # e_proj, h_proj
    return {"fwd": fwd + dense, "bwd": bwd + 2 * dense}


def finetune_flops(config: DeepseekV4ModelConfig, cu_seqlens: Tensor | Sequence[int], *, frozen_macs: float,
                   fp8_macs: float = 0.0, lora_rank: int = 0, lora_io: float = 0.0) -> dict[str, float]:
    """The FLOPs one fine-tuning step runs: :func:`model_flops` less the weight-gradient GEMMs of frozen weights,
    plus LoRA's GEMMs, with the part run on FP8 tensor cores apart.

    Args:
        config, cu_seqlens: as :func:`model_flops`.
        frozen_macs: multiply-adds per token of the frozen weight matrices (the routed experts: the ``k`` a token
            runs; the planner's ``count_groups(config).total()[group].macs`` summed over the frozen groups): their
            weight-gradient GEMM (``2 x macs`` per token) does not run.
        fp8_macs: the part of ``frozen_macs`` multiplied in FP8 (forward and input gradient; ``compute="fp8"``, a
            weight-only base multiplies in bf16).
        lora_rank: ``r``. lora_io: multiply-adds per token and rank of the LoRA pairs, all run factored (``x A^T
            B^T``; the routed experts' pairs for the ``k`` experts a token runs): ``2 r lora_io`` per token forward,
            twice that backward (input and factor gradients).

    Returns:
        ``{"fwd", "bwd", "fp8"}``: forward and backward FLOPs run (FP8 ones included: MFU divides their sum by the
        bf16 peak) and the FP8 part of the two.
    """
    cu = [int(v) for v in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens)]
    T = float(cu[-1] - cu[0]) if cu else 0.0
    if min(frozen_macs, fp8_macs, lora_rank, lora_io) < 0 or fp8_macs > frozen_macs:
        raise ValueError("finetune_flops: counts must be >= 0 and fp8_macs a part of frozen_macs, got "
                         f"frozen_macs={frozen_macs}, fp8_macs={fp8_macs}, lora_rank={lora_rank}, lora_io={lora_io}")
    base = model_flops(config, cu)
    r = float(lora_rank)
    fwd = base["fwd"] + 2 * r * lora_io * T
    bwd = base["bwd"] - 2 * frozen_macs * T + 4 * r * lora_io * T
    return {"fwd": fwd, "bwd": bwd, "fp8": 4 * fp8_macs * T}
