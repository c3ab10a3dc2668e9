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

from ..models.deepseek_v4 import DeepseekV4ForCausalLM
from ..models.deepseek_v4.model import DecoderLayer, MTPBlock, TopParts, draw_unit
from ..models.deepseek_v4.moe import Experts
from ..models.deepseek_v4.quant import Fp8Experts, Fp8Linear

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
                    allow_inexact_fp8: bool = False, **overrides: object) -> DeepseekV4ForCausalLM:
    """Give the (meta, possibly sharded) ``model`` storage on ``device`` and the weights of the HF-format
    checkpoint ``path`` (plain, or FP8 / MXFP4 as released, dequantized on the way).

    Each decoder layer is read on its own (``load_pretrained(layers=[i], experts=...)``): every rank reads the
    layer's dense tensors and only its own routed experts, and keeps its FSDP shard of them. MTP blocks the
    checkpoint lacks keep fresh weights (``overrides['seed']``-independent: the model's own unit seeds).

    Quantized tensors are moved to ``device`` one at a time and dequantized or converted (MXFP4 -> FP8) there
    (``load_pretrained(convert_device=device)``): on a GPU a layer's experts take seconds, not minutes on the host.

    A model given FP8-held weights (``quant.hold_in_fp8`` before sharding) reads them as the release stores them
    (``load_pretrained(base_precision=...)``, ``fp8_linears`` when it holds dense ones: all that the checkpoint
    stores in FP8 that the model holds so), one expert matrix at a time. MXFP4 blocks that FP8 cannot
    hold exactly fail the load on every rank alike unless ``allow_inexact_fp8``.
    """
    from ..models.deepseek_v4.checkpoint import inexact_fp8_message, load_pretrained

    model.to_empty(device=device)
    c = model.config
    experts = local_experts(model)
    fields = {k: getattr(c, k) for k in c.training_dict()}
    fields.update(overrides)
    n_mtp = len(model.mtp)
    seed = int(fields.pop("seed", 0))
    held = _held(model)
    if held is not None:  # read as stored; FP8-held weights have no fresh values to start from
        fields.update(base_precision=held[0], fp8_linears=held[1], allow_inexact_fp8=True)
    # fresh MTP blocks first: the checkpoint's, when it has them, are copied over them below
    for prefix, fresh in _fresh_units(model, seed):
        if prefix.startswith("mtp.") and held is None:
            copy_into(model, fresh, prefix)
    inexact: dict[str, int] = {}
    for i in range(c.num_hidden_layers):
        part = load_pretrained(path, layers=[i], experts=experts, mtp=n_mtp > 0, num_nextn_predict_layers=n_mtp,
                               dtype=torch.float64 if _storage(model) == torch.float64 else torch.float32,
                               convert_device=device, **fields)
        fresh = set(part.load_report.fresh)
        if fresh and held is not None:
            raise ValueError(f"{path} has no mtp.* tensors and the model's MTP blocks hold FP8 weights, which cannot "
                             "start fresh: train without MTP blocks (--mtp-layers 0)")
        inexact.update(part.load_report.fp8_inexact)
        for name, value in _real_tensors(part):
            if name not in fresh:
                copy_into(model, value, name)
    if held is not None and not allow_inexact_fp8 and _any_rank(bool(inexact), device):
        raise ValueError(inexact_fp8_message(inexact) if inexact else "another rank's experts hold MXFP4 blocks "
                         "that FP8 cannot hold exactly (its error lists them); pass allow_inexact_fp8=True to round")
    return model


def _held(model: nn.Module) -> tuple[str, list[str]] | None:
    """``(compute, names of the FP8-held dense linears)`` of a model with FP8-held weights, else None."""
    experts = [m.compute for m in model.modules() if isinstance(m, Fp8Experts)]
    linears = {n: m.compute for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    if not experts and not linears:
        return None
    return (experts or list(linears.values()))[0], list(linears)


def _any_rank(flag: bool, device: torch.device | str) -> bool:
    """``flag`` or-ed over every rank (itself without a process group): one decision on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t)
    return bool(t.item())


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
            try:
                _copy_sharded(own[name], value)
            except ValueError as err:
                raise ValueError(f"tensor {name!r}: {err}") from None


def _copy_sharded(dest: Tensor, value: Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if tuple(dest.shape) != tuple(value.shape):
        raise ValueError(f"shape {tuple(value.shape)} does not fit the model's {tuple(dest.shape)}")
    if (dest.dtype == torch.float8_e4m3fn) != (value.dtype == torch.float8_e4m3fn):
        raise ValueError(f"the model holds {dest.dtype} where the source has {value.dtype}: FP8-held weights are "
                         "read as a release checkpoint stores them (load_hf_sharded), never cast from other values")
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

    yield "", draw_unit(seed, 0, lambda: TopParts(c))
    for i in range(c.num_hidden_layers):
        # this rank's experts only; each is drawn from its own generator, so the values do not depend on the mesh
        yield f"model.layers.{i}", draw_unit(seed, 1 + i, lambda i=i: DecoderLayer(c, i, experts))
    for j in range(len(model.mtp)):
        yield f"mtp.{j}", draw_unit(seed, 1 + c.num_hidden_layers + j, lambda j=j: MTPBlock(c, j, experts))

