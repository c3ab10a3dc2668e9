"""Weights for a model built on the meta device and sharded: fresh initialization or a per-rank HF import, one
FSDP unit at a time, so no rank ever holds more than one block beside its shards.

Fresh weights are drawn unit by unit on the CPU, each unit from its own seed (and each routed expert from its
own generator, see ``Experts``), so the initial model is the same whatever the mesh: one process and every
sharding start from identical weights.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from ..layers.modules import RMSNorm
from ..models.deepseek_v4 import DeepseekV4ForCausalLM
from ..models.deepseek_v4.mhc import HyperHead
from ..models.deepseek_v4.model import DecoderLayer, MTPBlock
from ..models.deepseek_v4.moe import Experts

__all__ = ["materialize", "load_hf_sharded", "copy_into", "local_experts"]


def local_experts(model: DeepseekV4ForCausalLM) -> range | None:
    """The global expert ids this rank's MoE layers hold (``None``: all of them)."""
    for module in model.modules():
        if isinstance(module, Experts):
            return None if len(module.local) == module.num_experts else module.local
    return None


def materialize(model: DeepseekV4ForCausalLM, device: torch.device | str, seed: int) -> DeepseekV4ForCausalLM:
    """Give the (meta, possibly sharded) ``model`` storage on ``device`` and fresh weights from ``seed``."""
    model.to_empty(device=device)
    for prefix, fresh in _fresh_units(model, seed):
        copy_into(model, fresh, prefix)
    return model


def load_hf_sharded(model: DeepseekV4ForCausalLM, path: str, device: torch.device | str,
                    **overrides: object) -> DeepseekV4ForCausalLM:
    """Give the (meta, possibly sharded) ``model`` storage on ``device`` and the weights of the HF-format
    checkpoint ``path`` (plain, or FP8 / MXFP4 as released, dequantized on the way).

    Each decoder layer is read on its own (``load_pretrained(layers=[i], experts=...)``): every rank reads the
    layer's dense tensors and only its own routed experts, and keeps its FSDP shard of them. MTP blocks the
    checkpoint lacks keep fresh weights (``overrides['seed']``-independent: the model's own unit seeds).
    """
    from ..models.deepseek_v4.checkpoint import load_pretrained

    model.to_empty(device=device)
    c = model.config
    experts = local_experts(model)
    fields = {k: getattr(c, k) for k in c.training_dict()}
    fields.update(overrides)
    n_mtp = len(model.mtp)
    seed = int(fields.pop("seed", 0))
    # fresh MTP blocks first: the checkpoint's, when it has them, are copied over them below
    for prefix, fresh in _fresh_units(model, seed):
        if prefix.startswith("mtp."):
            copy_into(model, fresh, prefix)
    for i in range(c.num_hidden_layers):
        part = load_pretrained(path, layers=[i], experts=experts, mtp=n_mtp > 0, num_nextn_predict_layers=n_mtp,
                               dtype=torch.float64 if _storage(model) == torch.float64 else torch.float32,
                               **fields)
        fresh = set(part.load_report.fresh)
        for name, value in _real_tensors(part):
            if name not in fresh:
                copy_into(model, value, name)
    return model


def copy_into(model: nn.Module, source: nn.Module | Tensor, prefix: str = "") -> None:
    """Copy ``source`` (a module whose names continue ``prefix``, or one tensor named ``prefix``) into ``model``'s
    parameters and buffers of those names, each rank keeping its own shard of a sharded (``DTensor``) one."""
    items = [(prefix, source)] if isinstance(source, Tensor) else [
        (f"{prefix}.{n}" if prefix else n, t) for n, t in _real_tensors(source)]
    own = dict(model.named_parameters())
    own.update(model.named_buffers())
    with torch.no_grad():
        for name, value in items:
            if name not in own:
                raise KeyError(f"model has no parameter or buffer {name!r}")
            dest = own[name]
            _copy_sharded(dest, value)


def _copy_sharded(dest: Tensor, value: Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if tuple(dest.shape) != tuple(value.shape):
        raise ValueError(f"shape {tuple(value.shape)} does not fit the model's {tuple(dest.shape)}")
    if isinstance(dest, DTensor):
        # every rank has the whole value: each keeps its own chunk, no communication
        local = distribute_tensor(value.to(dest.dtype), dest.device_mesh, dest.placements, src_data_rank=None)
        dest.to_local().copy_(local.to_local())
    else:
        dest.copy_(value)


def _real_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Parameters and buffers (non-persistent too, e.g. RoPE frequencies) that hold values."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if not t.is_meta:
            yield name, t


def _storage(model: nn.Module) -> torch.dtype:
    from torch.distributed.tensor import DTensor

    p = next(model.parameters())
    return p.to_local().dtype if isinstance(p, DTensor) else p.dtype


def _fresh_units(model: DeepseekV4ForCausalLM, seed: int) -> Iterator[tuple[str, nn.Module]]:
    """``(prefix, module)`` of every unit of the model drawn fresh on the CPU in fp32, each from its own seed."""
    c = model.config
    experts = local_experts(model)

    def built(index: int, make) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + index)
            module = make()
            if isinstance(module, DecoderLayer):
                module.mlp.gate.init_hash_table(torch.Generator().manual_seed(seed * 1_000_003 + index))
        return module

    top = built(0, lambda: _TopParts(c))
    yield "", top
    for i in range(c.num_hidden_layers):
        # this rank's experts only; each is drawn from its own generator, so the values do not depend on the mesh
        yield f"model.layers.{i}", built(1 + i, lambda i=i: DecoderLayer(c, i, experts))
    for j in range(len(model.mtp)):
        yield f"mtp.{j}", built(1 + c.num_hidden_layers + j, lambda j=j: MTPBlock(c, j, experts))


class _TopParts(nn.Module):
    """The root unit's modules under their model names: embedding, final norm, hyper-head, LM head."""

    def __init__(self, c) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, c.pad_token_id)
        nn.init.normal_(self.model.embed_tokens.weight, std=c.initializer_range)
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.model.hc_head = HyperHead(c.hidden_size, c.hc_mult, c.hc_eps, c.rms_norm_eps, backend=c.attention_backend)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
            nn.init.normal_(self.lm_head.weight, std=c.initializer_range)
