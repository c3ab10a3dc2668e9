"""PEFT adapters on an HF ``DeepseekV4ForCausalLM`` patched by :mod:`csattn.integrations.transformers`.

Example (either order; ``patch`` takes the ``PeftModel`` too):
    >>> from peft import LoraConfig, get_peft_model
    >>> cfg = LoraConfig(r=16, target_modules=["q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"],
    ...                  target_parameters=["o_a_proj.weight", "experts.gate_up_proj", "experts.down_proj"])
    >>> model = get_peft_model(patch(model), cfg)      # or patch(get_peft_model(model, cfg))

PEFT puts its modules where HF's are; the patched model reaches them in one of two ways:

- modules it *calls* (:data:`CALLED`: ``q_a_proj``, ``kv_proj``, the compressors' and the indexer's ``kv_proj`` /
  ``gate_proj`` / ``weights_proj``, the MoE block's router and shared experts, ``embed_tokens``): PEFT's own
  forward runs, so any PEFT module there works as in HF;
- the routed experts: LoRA on their tensors (``target_parameters``) runs per expert through csattn's grouped GEMMs
  (:func:`expert_loras`; ``W + delta`` is never formed, and FP8-held experts take LoRA the same way);
- projections whose weight it *reads* (``HybridAttention.READ_PROJECTIONS``: ``q_b_proj``, ``o_a_proj``,
  ``o_b_proj``, the indexer's ``q_b_proj``; the fused core recomputes them block by block): the layer reads
  :func:`effective_weight`, the base weight plus every active LoRA adapter's ``get_delta_weight`` (PEFT's own
  math, differentiable in ``lora_A`` / ``lora_B``; disabled adapters and merged ones as PEFT's forward treats
  them). Only plain LoRA can be honoured there: ``lora_dropout > 0`` (it drops the adapter's input, which a weight
  cannot), DoRA and the other LoRA variants, ``lora_bias``, other tuner types, ``modules_to_save`` and mixed adapter
  batches (``adapter_names=``) are refused with an error naming the module.

Anything PEFT puts elsewhere (the mHC sites, the norms, the compressors' ``position_bias``, ...) is never called by
the patched model and is refused. :func:`check_adapters` runs at ``patch`` and at every forward of the patched
model, so adapters added after ``patch`` (``get_peft_model``, ``add_adapter``) are checked too.

PEFT is optional: when ``peft`` was never imported, no model can hold a PEFT module and nothing here imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..layers import HybridAttention
from ..ops.moe import ExpertLora
from . import hf_fp8

__all__ = ["CALLED", "READ", "check_adapters", "detach", "effective_weight", "expert_loras", "innermost", "reattach",
           "unwrap_model", "wrappers"]

# modules of a decoder layer the patched model calls (their forward runs); "mlp" covers everything under it
CALLED = (
    "self_attn.q_a_proj", "self_attn.kv_proj", "self_attn.compressor.kv_proj", "self_attn.compressor.gate_proj",
    "self_attn.compressor.indexer.kv_proj", "self_attn.compressor.indexer.gate_proj",
    "self_attn.compressor.indexer.scorer.weights_proj",
)
# projections of a decoder layer whose weight the patched attention reads
READ = tuple(f"self_attn.{name}" for name in HybridAttention.READ_PROJECTIONS)
_EXPERTS = "mlp.experts"
_HOW = ("LoRA on q_a_proj, kv_proj, q_b_proj, o_b_proj and the indexer's linears (target_modules), on "
        "o_a_proj.weight and experts.gate_up_proj / experts.down_proj (target_parameters), anything under mlp")


class _Peft(NamedTuple):
    tuner_layer: type
    aux_wrapper: type
    lora_linear: type
    param_wrapper: type
    peft_model: type
    base_tuner: type


def _peft() -> _Peft | None:
    """PEFT's classes, or None when ``peft`` was never imported (then no object can be one of them)."""
    if "peft" not in sys.modules:
        return None
    from peft import PeftModel
    from peft.tuners.lora.layer import Linear, ParamWrapper
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return _Peft(BaseTunerLayer, AuxiliaryTrainingWrapper, Linear, ParamWrapper, PeftModel, BaseTuner)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``PeftModel`` (or PEFT's tuner model); ``model`` itself otherwise."""
    peft = _peft()
    if peft is not None and isinstance(model, peft.peft_model):
        model = model.base_model
    if peft is not None and isinstance(model, peft.base_tuner):
        model = model.model
    return model


def _is_wrapper(module: nn.Module, peft: _Peft | None) -> bool:
    return peft is not None and isinstance(module, (peft.tuner_layer, peft.aux_wrapper))


def _inner(wrapper: nn.Module, peft: _Peft) -> nn.Module:
    return wrapper.base_layer if isinstance(wrapper, peft.tuner_layer) else wrapper.original_module


def _chain(module: nn.Module) -> Iterator[nn.Module]:
    """The PEFT wrappers around a module, outermost first (nested ones wrap each other's ``base_layer``)."""
    peft = _peft()
    while _is_wrapper(module, peft):
        yield module
        module = _inner(module, peft)


def innermost(module: nn.Module) -> nn.Module:
    """The module PEFT wrapped (``module`` itself when it is no PEFT wrapper)."""
    peft = _peft()
    while _is_wrapper(module, peft):
        module = _inner(module, peft)
    return module


def wrappers(root: nn.Module) -> dict[str, nn.Module]:
    """The outermost PEFT wrappers under ``root``, by path relative to it. Walks the model's own modules only, not
    the adapters' (it runs at every forward of the patched model)."""
    peft = _peft()
    found: dict[str, nn.Module] = {}

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if _is_wrapper(child, peft):
                found[prefix + name] = child
            else:
                walk(child, f"{prefix}{name}.")

    if peft is not None:
        walk(root, "")
    return found


def detach(root: nn.Module) -> dict[str, nn.Module]:
    """Replace every PEFT wrapper under ``root`` by the module it wraps; returns them for :func:`reattach`."""
    found = wrappers(root)
    for path, wrapper in found.items():
        root.set_submodule(path, innermost(wrapper))
    return found


def reattach(root: nn.Module, found: dict[str, nn.Module]) -> None:
    """Put :func:`detach`'s wrappers back at their paths, each around the module now there (its parameters are
    the ones the wrapper held: ``patch`` / ``unpatch`` move parameter objects, never copy them)."""
    peft = _peft()
    for path, wrapper in found.items():
        last = list(_chain(wrapper))[-1]
        base = root.get_submodule(path)
        if isinstance(last, peft.tuner_layer):
            last.base_layer = base
        else:
            last.original_module = base
        root.set_submodule(path, wrapper)


# ---------------------------------------------------------------------------------------------- checks
def check_adapters(backbone: nn.Module) -> None:
    """Refuse every PEFT module under ``backbone`` (a ``DeepseekV4Model``) that the patched model would not honour.

    Raises:
        ValueError: naming the module, what is wrong and what to do instead.
    """
    peft = _peft()
    if peft is None:
        return
    for path, wrapper in wrappers(backbone).items():
        _check_hooks(f"model.{path}", wrapper)
        if path == "embed_tokens":
            continue
        parts = path.split(".")
        if len(parts) < 3 or parts[0] != "layers":
            raise ValueError(f"model.{path}: a {_kind(wrapper)} (PEFT) on a module the csattn-patched model does not "
                             f"call, so it would change nothing; remove it from the PEFT config. Supported: {_HOW}")
        local = ".".join(parts[2:])
        _check_layer_wrapper(f"model.{path}", local, wrapper, peft)


def _check_hooks(where: str, wrapper: nn.Module) -> None:
    """PEFT's mixed adapter batches tag each row of a module's input with its adapter by a forward pre-hook; the
    patched model runs the batch's tokens as packed rows (and reads some weights without calling the module)."""
    for w in _chain(wrapper):
        for hook in w._forward_pre_hooks.values():
            if isinstance(hook, partial) and "adapter_names" in hook.keywords:
                raise ValueError(f"{where}: mixed adapter batches (adapter_names=) do not run on the csattn-patched "
                                 "model (its rows are packed tokens, not batch rows); run one adapter per batch "
                                 "(set_adapter), or unpatch the model for this")


def _check_layer_wrapper(where: str, local: str, wrapper: nn.Module, peft: _Peft) -> None:
    if local == "mlp":
        raise ValueError(f"{where}: a {_kind(wrapper)} (PEFT) on the whole MoE block, whose parts the csattn-patched "
                         "layer calls one by one; name them instead (mlp.gate, mlp.shared_experts, LoRA's "
                         "target_parameters for the experts)")
    in_mlp = local.startswith("mlp.")  # HF's MoE block: the patched layer calls all of its parts
    if local in CALLED or (in_mlp and local != _EXPERTS):
        return  # its forward runs, as in HF
    if local == _EXPERTS:
        for w in _chain(wrapper):
            if type(w) is not peft.param_wrapper:
                raise ValueError(f"{where}: a {_kind(w)} (PEFT) on the routed experts, which csattn runs through its "
                                 "grouped GEMMs: use LoRA's target_parameters=['experts.gate_up_proj', "
                                 "'experts.down_proj'] (or unpatch the model)")
        return
    if local not in READ:
        raise ValueError(f"{where}: a {_kind(wrapper)} (PEFT) on a module the csattn-patched model does not call "
                         f"(it reads the parameters itself), so it would change nothing; remove it from the PEFT "
                         f"config. Supported: {_HOW}")
    for w in _chain(wrapper):
        _check_read_lora(where, local, w, peft)


def _check_read_lora(where: str, local: str, w: nn.Module, peft: _Peft) -> None:
    """A wrapper on a projection whose weight the fused core reads: plain LoRA on ``weight`` only."""
    what = f"{where}: csattn's fused attention reads this projection's weight (it never calls the module)"
    if type(w) is peft.lora_linear:
        if local == "self_attn.o_a_proj":
            raise ValueError(f"{where}: LoRA as a module (target_modules) on the grouped o_a_proj adds one dense "
                             "output per group, which HF's own forward cannot add either; put LoRA on its weight: "
                             "target_parameters=['self_attn.o_a_proj.weight']")
    elif type(w) is peft.param_wrapper:
        if w.parameter_name != "weight":
            raise ValueError(f"{what}; LoRA on its {w.parameter_name!r} is not supported")
        return  # PEFT's ParamWrapper itself refuses dropout, DoRA and bias (mixed batches: _check_hooks)
    else:
        raise ValueError(f"{what}, so only plain LoRA can be honoured there, got a {_kind(w)}; use LoRA, or leave "
                         f"{local.rpartition('.')[2]} out of the PEFT config")
    for name in w.lora_A:
        dropout = w.lora_dropout[name]
        if isinstance(dropout, nn.Dropout) and dropout.p > 0:
            raise ValueError(f"{what}, so the adapter {name!r} cannot drop its own input (lora_dropout="
                             f"{dropout.p}); set lora_dropout=0, or leave {local.rpartition('.')[2]} out of "
                             "target_modules")
        if name in w.lora_variant:
            raise ValueError(f"{what}, so only plain LoRA can be honoured there; the adapter {name!r} is a "
                             f"{type(w.lora_variant[name]).__name__} (e.g. use_dora=True): use plain LoRA, or leave "
                             f"{local.rpartition('.')[2]} out of target_modules")
        if w.lora_bias.get(name):
            raise ValueError(f"{what}; the adapter {name!r} has lora_bias=True, which csattn cannot add there: set "
                             "lora_bias=False")


def _kind(module: nn.Module) -> str:
    return f"{type(module).__module__.rpartition('.')[0] or type(module).__module__}.{type(module).__name__}"


# ---------------------------------------------------------------------------------------------- effective weights
def _unmerged_active(wrapper: nn.Module, base: nn.Module, where: str, held: str) -> bool:
    """Whether ``wrapper``'s active adapters add to what reads ``base``, as in PEFT's forward: disabled adapters add
    nothing (and unmerge what was merged), merged ones add nothing (``base`` holds them; refused where ``base`` is
    FP8-held, ``held`` naming it, as the delta rounds into the e4m3 codes)."""
    if wrapper.disable_adapters:
        if wrapper.merged:
            wrapper.unmerge()
        return False
    if wrapper.merged and hf_fp8.is_held(base):
        raise ValueError(f"{where}: LoRA merged into {held} (its delta rounds into the e4m3 codes); unmerge_adapter() "
                         "and train the adapter beside it")
    return not wrapper.merged


def effective_weight(module: nn.Module, where: str = "") -> Tensor:
    """The weight a linear ``module`` multiplies by, with the LoRA adapters PEFT put on it.

    ``module`` is an ``nn.Linear`` (or csattn / HF grouped linear, or HF's FP8 one: its weight dequantized in the
    model's compute dtype, frozen) or a chain of PEFT LoRA wrappers around one (``lora.Linear``,
    ``lora.ParamWrapper`` on ``weight``). Returns ``base.weight`` plus, for every active adapter of
    every wrapper, ``get_delta_weight(adapter)`` cast to the weight's dtype (differentiable in ``lora_A`` /
    ``lora_B``, so the adapters train through whatever consumes the weight). As in PEFT's forward: a wrapper with
    adapters disabled adds nothing (and unmerges what it merged); a merged wrapper adds nothing (its base holds it).
    ``where`` names the module in errors.
    """
    chain = list(_chain(module))
    base = innermost(module)
    weight = hf_fp8.weight_of(base)  # an HF FP8 linear's dequantized (frozen)
    if not chain:
        return weight
    deltas = []
    for w in chain:
        if w._forward_pre_hooks or w._forward_hooks:
            raise ValueError(f"{where or type(w).__name__}: csattn's fused attention reads this projection's weight "
                             "and never calls the module, so forward hooks on it (PEFT's mixed adapter batches, "
                             "adapter_names=) would not run; run one adapter per batch (set_adapter)")
        if not _unmerged_active(w, base, where or type(w).__name__, "an FP8-held weight"):
            continue
        deltas += [w.get_delta_weight(name) for name in w.active_adapters if name in w.lora_A]
    for delta in deltas:
        weight = weight + delta.to(weight.dtype)
    return weight


def expert_loras(experts: nn.Module, shapes: dict[str, tuple[int, int]], where: str) -> dict[str, ExpertLora]:
    """PEFT's LoRA on the routed experts' tensors (``target_parameters``: ``ParamWrapper`` s around ``experts``) as
    csattn's per-expert pairs, by parameter name, for :func:`csattn.ops.moe.moe_experts` (which never forms
    ``W + delta``, and runs FP8-held experts too).

    ``shapes``: each adapted tensor's ``(out, in)`` per expert (``gate_up_proj``: ``(2I, D)``). PEFT's
    ``lora_A.weight [E r, in]`` gives ``a [E, r, in]`` (rows ``e r .. e r + r``), ``lora_B.weight [out, r E]`` gives
    ``b [E, out, r]`` (columns ``j E + e``), as its ``get_delta_weight``. Several active adapters on one tensor are
    one pair of their ranks side by side, each ``b`` times its own scale. As in PEFT's forward: disabled wrappers
    add nothing (and unmerge), merged ones add nothing (their base holds the delta; refused on FP8-held experts).
    """
    inner = innermost(experts)
    found: dict[str, list[tuple[Tensor, Tensor, float]]] = {}
    for w in _chain(experts):
        if not _unmerged_active(w, inner, where, "FP8-held experts"):
            continue
        name = w.parameter_name
        out, inp = shapes[name]
        for adapter in (a for a in w.active_adapters if a in w.lora_A):
            a, b = w.lora_A[adapter].weight, w.lora_B[adapter].weight
            e = w.num_experts
            if not w._did_swap_in_out_features or a.shape[-1] != inp or b.shape[0] != out or a.shape[0] % e:
                raise ValueError(
                    f"{where}.{name}: PEFT sized the adapter {adapter!r} as lora_A {tuple(a.shape)}, lora_B "
                    f"{tuple(b.shape)} for {e} experts, which does not fit the experts' [{out}, {inp}] weights (FP4-"
                    "packed experts hold half the columns, so PEFT's factors for them are wrong); leave the "
                    "experts out of target_parameters, or load the experts as FP8 / bf16")
            found.setdefault(name, []).append(ExpertLora.from_peft(a, b, e, float(w.scaling[adapter])))
    loras = {}
    for name, pairs in found.items():
        if len(pairs) == 1:
            loras[name] = pairs[0]
        else:
            loras[name] = ExpertLora(torch.cat([a for a, _, _ in pairs], 1),
                                     torch.cat([b * s for _, b, s in pairs], 2), 1.0)
    return loras
