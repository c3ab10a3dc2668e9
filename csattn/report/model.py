"""The model rows of the report: one training step of the DeepSeek-V4 proxy (csattn, and HF eager where it fits).

The proxy is the 4-layer V4-Flash geometry the model benchmarks use (``benchmarks/configs/v4_flash_proxy.json`` is
written from :func:`proxy_config`): hidden 4096, H 64, d 512, layers W / CSA / HCA / CSA, the first MoE layer
hash-routed, ``experts`` routed experts top-``topk`` of intermediate 2048, one shared expert, hc_mult 4, vocab
32000. ``geometry="tiny"`` shrinks every width for CPU smoke runs. Documents: ``T/4 - 100, T/4 + 100, T/2``
(csattn); HF cannot pack, so its rows run one document of ``T`` tokens, and so does the csattn row beside it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ..models.deepseek_v4.flops import PEAK_FLOPS, model_flops
from ..ops.backend import BackendChoice

__all__ = ["proxy_config", "proxy_lengths", "proxy_model", "proxy_batch", "model_step_record", "PEAK_TFLOPS"]

PEAK_TFLOPS = PEAK_FLOPS / 1e12  # the MFU denominator in TFLOP/s
_W, _C, _H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def proxy_config(geometry: str = "real", experts: int = 8, topk: int = 2, layers: int = 4, recompute: str = "none",
                 backend: BackendChoice = "auto", indexer_loss_coeff: float = 0.01) -> Any:
    """The ``DeepseekV4ModelConfig`` of the model proxy (``"real"``: V4-Flash widths; ``"tiny"``: CPU-sized)."""
    from ..models.deepseek_v4 import DeepseekV4ModelConfig

    pattern = [_W, _C, _H, _C]
    kw: dict[str, Any] = dict(
        vocab_size=32000, num_hidden_layers=layers, layer_types=[pattern[i % 4] for i in range(layers)],
        mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1), n_routed_experts=experts, num_experts_per_tok=topk,
        num_nextn_predict_layers=0, recompute=recompute, backend=backend,
        indexer_loss_coeff=indexer_loss_coeff,
    )
    if geometry == "tiny":
        kw.update(vocab_size=256, hidden_size=64, num_attention_heads=4, head_dim=32, partial_rotary_factor=0.25,
                  q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=16, index_n_heads=4, index_head_dim=16,
                  index_topk=8, moe_intermediate_size=32, compress_rates={_C: 4, _H: 16})
    elif geometry != "real":
        raise ValueError(f"geometry must be 'real' or 'tiny', got {geometry!r}")
    return DeepseekV4ModelConfig(**kw)


def proxy_lengths(tokens: int, one_document: bool = False) -> list[int]:
    """Documents of the proxy's step: ``T/4 - 100, T/4 + 100, T/2`` (``[T]`` with ``one_document``)."""
    if one_document:
        return [tokens]
    quarter = tokens // 4
    return [quarter - min(100, quarter // 2), quarter + min(100, quarter // 2), tokens - 2 * quarter]


def proxy_model(config: Any, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> Any:
    """``DeepseekV4ForCausalLM(config)`` from ``seed``, in the training ``dtype`` (mHC, norms, biases fp32), on
    ``device``. Built on the CPU: the hash-routing tables are drawn from a CPU generator."""
    from ..models.deepseek_v4 import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    return DeepseekV4ForCausalLM(config).to_training_dtype(dtype).to(device)


def proxy_batch(lengths: list[int], vocab: int, device: torch.device | str, seed: int = 0):
    """Random token ids of packed documents ``lengths``: ``ids [T]``, their ``PackedSeqs``, next-token labels."""
    from ..models.deepseek_v4.model import future_tokens
    from ..packing import PackedSeqs

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=gen).to(device)
    packed = PackedSeqs.from_lengths(lengths, device=device)
    return ids, packed, future_tokens(ids, packed, 1)[0]


def _time_steps(step, steps: int, device: torch.device) -> list[float]:
    times = []
    for i in range(steps + 1):  # one warm-up step: compilation, caches
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def model_step_record(path: str, tokens: int, experts: int, topk: int, opts: dict) -> dict:
    """Time ``opts["steps"]`` training steps (forward + backward) of the proxy on ``path`` (``"csattn"`` or ``"hf"``)
    and return the report record (ms, peak GiB beyond the weights, tokens/s, model TFLOP/s, MFU on CUDA)."""
    device = torch.device(opts["device"])
    dtype = getattr(torch, opts["dtype"])
    one = path == "hf" or opts.get("model_one_document", False)
    lengths = proxy_lengths(tokens, one)
    rec: dict[str, Any] = {"kind": "model", "layer": f"model {experts}x{topk}", "tokens": tokens, "path": path,
                           "cp": 1, "partition": "-", "docs": lengths}
    cfg = proxy_config(opts["geometry"], experts, topk, backend="auto" if device.type == "cuda" else "reference")
    ours = proxy_model(cfg, dtype, "cpu")
    ids, packed, labels = proxy_batch(lengths, cfg.vocab_size, device, seed=tokens)
    if path == "csattn":
        model = ours.to(device)

        def loss():
            return model(ids, packed=packed, labels=labels, return_logits=False).loss
    elif path == "hf":
        from .hf import build_hf_model

        model = build_hf_model(cfg, ours.state_dict(), device, dtype)
        batch = ids[None]

        def loss():
            return model(input_ids=batch, labels=batch, logits_to_keep=0).loss
    else:
        raise ValueError(f"model path must be 'csattn' or 'hf', got {path!r}")
    del ours
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        for p in params:
            p.grad = None
        loss().backward()

    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = _time_steps(step, int(opts["steps"]), device)
    except torch.cuda.OutOfMemoryError:
        rec["error"] = "out of memory"
        return rec
    ms = statistics.median(times)
    f = model_flops(cfg, [0, *torch.tensor(lengths).cumsum(0).tolist()])
    rec.update(ms=ms, tokens_per_s=tokens / ms * 1e3, tflops=(f["fwd"] + f["bwd"]) / ms / 1e9,
               flops_fwdbwd=f["fwd"] + f["bwd"])
    if device.type == "cuda":
        rec["peak_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
        rec["mfu"] = rec["tflops"] / PEAK_TFLOPS
    return rec
