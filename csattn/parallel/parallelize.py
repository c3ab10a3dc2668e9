"""Apply expert parallelism, FSDP2 and context parallelism to a :class:`DeepseekV4ForCausalLM` from outside.

The model code knows no FSDP: this module narrows each MoE to its rank's experts (``MoE.use_expert_parallel``),
makes every decoder layer and MTP block an FSDP2 unit (its routed experts a unit of their own on the experts'
mesh), keeps the embedding, LM head and final norm / hyper-head in the root unit, and returns the
``ContextParallel`` the forward takes. Call it on the model built on the meta device, then
:func:`csattn.parallel.init.materialize` (or an import) gives the weights; every rank builds the same model.

Gradients: each rank's loss is its rows' summed cross entropy over the label count of the whole global batch, so
the gradient of the global batch is the **sum** of the ranks' gradients. Every FSDP unit therefore reduces with a
divide factor of 1 (set on each unit: a factor set on the root alone leaves the others at their default mean).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..models.deepseek_v4 import DeepseekV4ForCausalLM
from ..models.deepseek_v4.expert_parallel import ExpertParallel
from ..models.deepseek_v4.model import MTPBlock
from ..models.deepseek_v4.moe import Experts, MoE
from .mesh import Meshes

__all__ = ["parallelize", "decoder_blocks", "uses_fsdp"]


def decoder_blocks(model: DeepseekV4ForCausalLM) -> list[nn.Module]:
    """The FSDP units under the root, in forward order: decoder layers, then MTP blocks."""
    return [*model.model.layers, *model.mtp]


def uses_fsdp(meshes: Meshes, param_dtype: torch.dtype | None) -> bool:
    """FSDP shards the model on any mesh of more than one rank, and on one rank when a compute dtype other than
    the storage dtype is asked for (FSDP's mixed precision is the way that is done)."""
    return meshes.dense is not None and (meshes.distributed or param_dtype is not None)


def parallelize(model: DeepseekV4ForCausalLM, meshes: Meshes, *, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = torch.float32, cp_partition: str = "contiguous",
                reshard_after_forward: bool = True, prepare: Callable[[nn.Module], None] | None = None) -> Any:
    """Shard ``model`` in place over ``meshes``; returns the ``ContextParallel`` for its forward (``None`` without
    context parallelism).

    Args:
        model: built on the meta device (or anywhere: tensors that hold values keep them, sliced to the rank's
            experts), every rank the same.
        meshes: :func:`csattn.parallel.build_meshes`'s meshes.
        param_dtype: compute dtype of the FSDP units' parameters (e.g. ``torch.bfloat16`` over fp32 storage);
            ``None`` computes in the storage dtype. The mHC modules and the RMSNorms are units of their own that
            stay in their storage dtype (at least fp32, as in the released checkpoints); the attention sinks and
            the compressor's position biases, which are parameters of larger modules, compute in ``param_dtype``.
        reduce_dtype: dtype of the gradient reduction (default fp32; ``None`` = the parameters' dtype).
        cp_partition: ``"contiguous"`` or ``"balanced"`` (see ``csattn.ContextParallel``).
        reshard_after_forward: free each unit's gathered parameters after its forward (gathered again for the
            backward): less memory for one more all-gather per unit.
        prepare: run on the model after its experts are split over ``ep`` and before FSDP wraps it (the parameters
            it adds or freezes, e.g. ``csattn.finetune``'s adapters, are sharded with their units).
    """
    dims = meshes.dims
    if dims.ep > 1:
        for module in model.modules():
            if isinstance(module, MoE):
                module.use_expert_parallel(ExpertParallel(meshes.ep_group, module.gate.num_experts))
    if prepare is not None:
        prepare(model)
    if uses_fsdp(meshes, param_dtype):
        _fully_shard(model, meshes, param_dtype, reduce_dtype, reshard_after_forward)
    if dims.cp > 1:
        from ..cp import ContextParallel

        return ContextParallel(meshes.cp_group, partition=cp_partition)
    return None


class _NormReadInsideMHC(logging.Filter):
    """Drops FSDP's warning that an mHC unit's RMSNorm "did not run forward". The mHC module reads the norm's
    weight inside its own fused forward and never calls the norm, so the norm's pre-forward hook never fires; the
    unit is gathered by the mHC's hook all the same, and its gradients reduce with the unit (the sharded tests
    check every gradient against one process). Other modules that skip their forward still warn."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("did not run forward" in message and message.rstrip().endswith("[FSDPRMSNorm()]"))


def _quiet_norm_warning() -> None:
    log = logging.getLogger("torch.distributed.fsdp.fully_shard")
    if not any(isinstance(f, _NormReadInsideMHC) for f in log.filters):
        log.addFilter(_NormReadInsideMHC())


def _fully_shard(model: DeepseekV4ForCausalLM, meshes: Meshes, param_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None, reshard_after_forward: bool) -> None:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    dense = meshes.dense if meshes.dims.dp_replicate > 1 else meshes.dense["dp_shard_cp"]
    experts = meshes.experts["dp_replicate", "efsdp"] if meshes.dims.dp_replicate > 1 else meshes.experts["efsdp"]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # the mHC modules with the RMSNorm each one applies (it reads the norm's weight, never calls it): kept in
    # their (>= fp32) storage dtype whatever the compute dtype, as units of their own
    keep = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype)
    _quiet_norm_warning()

    # FP8-held frozen modules (``frozen_storage``: e4m3 codes + scales) are never cast to param_dtype (the codes
    # would lose their scales); they compute in it (``.to`` moves only their compute dtype). Held experts are a
    # unit without a cast; held dense linears stay out of FSDP, replicated (their ``weight`` reads as the
    # dequantized tensor, which FSDP cannot manage; they are a small part of the bytes)
    held = [m for m in model.modules() if getattr(m, "frozen_storage", None)]
    for m in held:
        if param_dtype is not None:
            m.to(param_dtype)
    ignored = {p for m in held if not isinstance(m, Experts) for p in m.parameters()}

    def unit(modules: list[nn.Module], mp: MixedPrecisionPolicy) -> None:
        fully_shard(modules, mesh=dense, mp_policy=mp, reshard_after_forward=reshard_after_forward)

    for block in decoder_blocks(model):
        fully_shard(block.mlp.experts, mesh=experts, mp_policy=keep if block.mlp.experts in held else policy,
                    reshard_after_forward=reshard_after_forward)
        if param_dtype is not None:
            unit([block.attn_hc, block.input_layernorm], keep)
            unit([block.ffn_hc, block.post_attention_layernorm], keep)
        if isinstance(block, MTPBlock):  # the model applies an MTP block's head outside the block's forward
            unit([block.hc_head, block.norm], keep if param_dtype is not None else policy)
        fully_shard(block, mesh=dense, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                    ignored_params=ignored or None)
    if param_dtype is not None:
        unit([model.model.hc_head, model.model.norm], keep)
    # the root's parameters (embedding, LM head) are needed again right at the backward's start
    fully_shard(model, mesh=dense, mp_policy=policy, reshard_after_forward=False, ignored_params=ignored or None)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # a plain sum: gloo has no pre-multiplied sum, and NCCL's zero-copy path takes only sums
            module.set_force_sum_reduction_for_comms(True)
