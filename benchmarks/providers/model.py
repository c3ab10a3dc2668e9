"""Providers for ``--op model``: one training step (forward + backward) of a DeepSeek-V4 model on a packed batch.

- ``csattn``: ``DeepseekV4ForCausalLM`` (fused attention, mHC and MoE kernels on CUDA; ``recompute`` as the
  shape option says), bf16 weights with the mHC, norms and biases in fp32, loss without ``[T, V]`` logits;
- ``hf``: Hugging Face ``transformers.DeepseekV4ForCausalLM`` (eager attention and experts) with the same
  weights and tokens. HF cannot pack: it runs the stream as one sequence ``[1, T]`` (use ``docs=one`` for
  the side-by-side row, so both see one document);
- ``hf_patched``: the same HF model after :func:`csattn.integrations.transformers.patch` (csattn's attention, mHC
  and MoE ops under HF's modules, HF's head and loss), on a padding-free ``[1, T]`` batch whose ``position_ids``
  restart at each document: what a ``transformers.Trainer`` user gets.

The model defaults to the 4-layer V4-Flash proxy of ``benchmarks/configs/v4_flash_proxy.json`` (hidden 4096,
H 64, d 512, layers W / CSA / HCA / CSA, first MoE layer hash-routed, 8 experts top-2, intermediate 2048,
hc_mult 4, vocab 32000); ``experts`` / ``topk_experts`` / ``layers`` change it. Documents: ``docs=ragged``
is ``T/4 - 100, T/4 + 100, T/2``; ``docs=one`` is one document of ``T``.

FLOPs are :func:`csattn.report.model_flops` (every matrix product on real tokens, attention over the keys each
row sees; recomputation not counted), so TFLOP/s / 790 is the H200's model FLOPs utilization (MFU).
"""

from __future__ import annotations

import os

import torch

from csattn.models.deepseek_v4.flops import model_flops
from csattn.report.model import proxy_model

from ..registry import Case, Skip, register

DEFAULTS = dict(tokens=16384, docs="ragged", experts=8, topk_experts=2, layers=4, recompute="none", seed=0)
PROXY_JSON = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "v4_flash_proxy.json")
W, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def proxy_config(shape: dict, backend: str = "auto"):
    """The model of ``shape``: :func:`csattn.report.model.proxy_config` (``PROXY_JSON`` is its config.json)."""
    from csattn.report.model import proxy_config as build

    # "block+offload" / "full+offload": that recompute with the block inputs in host memory
    recompute, _, extra = str(shape["recompute"]).partition("+")
    if extra not in ("", "offload"):
        raise Skip(f"recompute takes a choice and optionally '+offload', got {shape['recompute']!r}")
    cfg = build("real", int(shape["experts"]), int(shape["topk_experts"]), int(shape["layers"]), recompute, backend)
    cfg.offload_block_inputs = extra == "offload"
    return cfg


def doc_lengths(tokens: int, docs: str) -> list[int]:
    from csattn.report.model import proxy_lengths

    if docs not in ("ragged", "one"):
        raise Skip(f"docs must be 'ragged' or 'one', got {docs!r}")
    return proxy_lengths(tokens, docs == "one")


def _batch(shape: dict, vocab: int, device):
    from csattn.report.model import proxy_batch

    lengths = doc_lengths(int(shape["tokens"]), shape["docs"])
    return (lengths, *proxy_batch(lengths, vocab, device, int(shape["seed"])))


def _info(cfg, lengths: list[int], model) -> dict:
    return {"tokens": sum(lengths), "docs": lengths, "params": sum(p.numel() for p in model.parameters()),
            "layers": cfg.num_hidden_layers, "experts": cfg.n_routed_experts, "topk": cfg.num_experts_per_tok,
            "recompute": cfg.recompute, "offload_block_inputs": cfg.offload_block_inputs}


@register("model", "csattn", DEFAULTS)
def csattn_model(shape, device, dtype, variant=""):
    if device.type != "cuda":
        raise Skip("the model step is timed on CUDA only")
    if variant not in ("", "deterministic"):
        raise Skip(f"csattn's model takes no variant but 'deterministic', got {variant!r}")
    cfg = proxy_config(shape)
    # "deterministic": every layer's AttentionConfig.deterministic (the kernels' fixed-point key gradients); torch's
    # own deterministic mode is process-wide: benchmarks.run --deterministic sets it for the whole run
    cfg.deterministic = variant == "deterministic"
    model = proxy_model(cfg, dtype, device, int(shape["seed"]))
    lengths, ids, packed, labels = _batch(shape, cfg.vocab_size, device)
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()

    def step():
        return (model(ids, packed=packed, labels=labels, return_logits=False).loss,)

    return Case(forward=step, leaves=[p for p in model.parameters() if p.requires_grad],
                flops=model_flops(cfg, cu), info=_info(cfg, lengths, model))


@register("model", "hf", DEFAULTS)
def hf_model(shape, device, dtype, variant=""):
    if device.type != "cuda":
        raise Skip("the model step is timed on CUDA only")
    if shape["recompute"] != "none":
        raise Skip("HF eager has no recompute choice")
    from csattn.report.hf import build_hf_model

    cfg = proxy_config(shape)
    ours = proxy_model(cfg, torch.float32, "cpu", int(shape["seed"]))  # the same weights, then handed to HF
    try:
        hf = build_hf_model(cfg, ours.state_dict(), device, dtype)
    except ImportError as e:
        raise Skip(f"transformers with DeepseekV4 is not installed ({e})") from e
    del ours
    lengths, ids, _, _ = _batch(shape, cfg.vocab_size, device)
    if len(lengths) > 1:
        raise Skip("HF cannot pack documents: use docs=one for the side-by-side row")
    ids = ids[None]

    def step():
        return (hf(input_ids=ids, labels=ids, logits_to_keep=0).loss,)

    return Case(forward=step, leaves=[p for p in hf.parameters() if p.requires_grad],
                flops=model_flops(cfg, [0, sum(lengths)]), info=_info(cfg, lengths, hf))


@register("model", "hf_patched", DEFAULTS)
def hf_patched_model(shape, device, dtype, variant=""):
    if device.type != "cuda":
        raise Skip("the model step is timed on CUDA only")
    if shape["recompute"] != "none":
        raise Skip("patch() has no recompute choice")
    from csattn.report.hf import build_hf_model

    cfg = proxy_config(shape)
    ours = proxy_model(cfg, torch.float32, "cpu", int(shape["seed"]))
    try:
        from csattn.integrations.transformers import patch

        hf = patch(build_hf_model(cfg, ours.state_dict(), device, dtype))
    except ImportError as e:
        raise Skip(f"transformers with DeepseekV4 is not installed ({e})") from e
    del ours
    lengths, ids, _, _ = _batch(shape, cfg.vocab_size, device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
    ids = ids[None]

    def step():
        return (hf(input_ids=ids, position_ids=positions, labels=ids, logits_to_keep=0).loss,)

    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    return Case(forward=step, leaves=[p for p in hf.parameters() if p.requires_grad],
                flops=model_flops(cfg, cu), info=_info(cfg, lengths, hf))
