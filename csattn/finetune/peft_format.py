"""Adapters in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``) under the names of Hugging
Face's ``DeepseekV4ForCausalLM``, which this model's module names equal; loading them back; the merged model.

What PEFT 0.21 builds from the config, and so what the file must hold:

* a linear in ``target_modules`` (HF calls all of them as modules, also those this model's attention core reads as
  weights): ``<module>.lora_A.weight [r, in]``, ``<module>.lora_B.weight [out, r]``;
* ``self_attn.o_a_proj.weight`` in ``target_parameters`` (HF's grouped linear reshapes its input, so a LoRA module
  there would not fit; PEFT's ``ParamWrapper`` adapts the 2-D weight itself): the same two tensors;
* the routed experts, ``mlp.experts.gate_up_proj`` then ``mlp.experts.down_proj`` in ``target_parameters``: PEFT
  nests one ``ParamWrapper`` per parameter, the first listed innermost, so gate_up's pair is
  ``mlp.experts.base_layer.lora_{A,B}.weight`` and down's ``mlp.experts.lora_{A,B}.weight``. Per expert ``e``
  with rank ``r``: ``lora_A.weight [E r, in]`` holds ``A_e`` in rows ``e r .. e r + r`` and ``lora_B.weight
  [out, r E]`` holds ``B_e`` in columns ``j E + e`` (``peft.tuners.lora.layer.ParamWrapper.get_delta_weight``).

Groups trained in full beside the LoRA (``--train``) go in as PEFT's ``modules_to_save``: the smallest modules that
own the trained parameters (an owner inside another is covered by it), each saved whole under its own name
(``<module>.<parameter or persistent buffer>``; a router's balance bias with it). An owner that also holds a LoRA
module is refused (PEFT wraps one or the other). The MTP blocks, which HF does not build, are left out of the
adapter (they train in the checkpoint and the merged export).

Scale ``lora_alpha / r`` everywhere (no rsLoRA). Every key starts with ``base_model.model.``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..ops.fp8 import dequantize
from ..ops.moe import ExpertLora
from .lora import LoraExperts, LoraSpec, lora_modules

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "adapter_tensors", "adapter_config", "save_adapter",
           "load_adapter", "read_adapter_config", "merged_config", "merged_state_dict", "merge_lora"]

SCALE_SUFFIX = "_scale_inv"  # an FP8-held tensor's block scales: HF's name of them

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
PEFT_VERSION = "0.21.2"

# a tensor of the whole model by its name (gathered under sharding; the identity in one process)
Gather = Callable[[str, Tensor], Tensor]


def _whole(name: str, t: Tensor) -> Tensor:
    return t.detach()


def _expert_keys(name: str) -> dict[str, str]:
    base = PREFIX + name
    return {"lora_A_gate_up": f"{base}.base_layer.lora_A.weight", "lora_B_gate_up": f"{base}.base_layer.lora_B.weight",
            "lora_A_down": f"{base}.lora_A.weight", "lora_B_down": f"{base}.lora_B.weight"}


def saved_modules(model: nn.Module) -> list[str]:
    """PEFT's ``modules_to_save``: the smallest modules owning the parameters trained in full (not the factors,
    not the MTP blocks'), those inside another one left out. Raises ``ValueError`` for an owner that holds a
    LoRA module too."""
    owners = dict.fromkeys(n.rpartition(".")[0] for n, p in model.named_parameters()
                           if p.requires_grad and ".lora_" not in n and not n.startswith("mtp."))
    outer = [o for o in owners if not any(o.startswith(other + ".") for other in owners if other != o)]
    adapted = [n for n, _ in lora_modules(model)]
    for owner in outer:
        inside = [n for n in adapted if n == owner or n.startswith(owner + ".")]
        if inside:
            raise ValueError(f"{owner} trains in full (its parameters are in --train's groups) and holds the LoRA "
                             f"module {inside[0]}: a PEFT adapter saves a module whole or adapts it, not both; "
                             "leave that group out of --train or out of --lora-targets")
    return outer


def adapter_tensors(model: nn.Module, gather: Gather = _whole) -> dict[str, Tensor]:
    """The adapter's tensors under PEFT's keys (contiguous, on the CPU). ``gather(name, t)``: the whole tensor of
    the model parameter ``name`` (a collective under sharding, :func:`csattn.parallel.export`'s ``_full``)."""
    out: dict[str, Tensor] = {}
    for owner in saved_modules(model):
        for key, t in model.get_submodule(owner).state_dict().items():
            out[f"{PREFIX}{owner}.{key}"] = gather(f"{owner}.{key}", t)
    for name, module in lora_modules(model):
        if isinstance(module, LoraExperts):
            keys = _expert_keys(name)
            full = {p: gather(f"{name}.{p}", getattr(module, p)) for p in keys}
            for which in ("gate_up", "down"):
                a, b = ExpertLora(full[f"lora_A_{which}"], full[f"lora_B_{which}"], 0.0).to_peft()
                out[keys[f"lora_A_{which}"]], out[keys[f"lora_B_{which}"]] = a, b
        else:
            out[f"{PREFIX}{name}.lora_A.weight"] = gather(f"{name}.lora_A", module.lora_A)
            out[f"{PREFIX}{name}.lora_B.weight"] = gather(f"{name}.lora_B", module.lora_B)
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def adapter_config(model: nn.Module, spec: LoraSpec) -> dict:
    """PEFT's ``LoraConfig`` fields for this model's adapter (``target_modules`` / ``target_parameters`` by full
    module name, so nothing else in HF's model matches)."""
    modules, params = [], []
    for name, module in lora_modules(model):
        if isinstance(module, LoraExperts):
            params += [f"{name}.gate_up_proj", f"{name}.down_proj"]
        elif name.endswith("self_attn.o_a_proj"):
            params.append(f"{name}.weight")
        else:
            modules.append(name)
    return {
        "peft_type": "LORA", "peft_version": PEFT_VERSION, "task_type": None, "base_model_name_or_path": None,
        "auto_mapping": {"base_model_class": "DeepseekV4ForCausalLM",
                         "parent_library": "transformers.models.deepseek_v4.modeling_deepseek_v4"},
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "use_rslora": False,
        "use_dora": False, "bias": "none", "lora_bias": False, "fan_in_fan_out": False, "init_lora_weights": True,
        "inference_mode": True, "target_modules": modules, "target_parameters": params,
        "modules_to_save": saved_modules(model) or None,
        "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None,
        "exclude_modules": None,
    }


def save_adapter(model: nn.Module, path: str, spec: LoraSpec, gather: Gather = _whole, write: bool = True) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` under ``path`` (every rank gathers with
    ``gather``; only where ``write`` do files get written). Each file goes to a ``.tmp`` name first and is renamed
    when complete."""
    from safetensors.torch import save_file

    tensors = adapter_tensors(model, gather)
    if not write:
        return
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, ADAPTER_WEIGHTS + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, ADAPTER_WEIGHTS))
    tmp = os.path.join(path, ADAPTER_CONFIG + ".tmp")
    with open(tmp, "w") as f:
        json.dump(adapter_config(model, spec), f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(path, ADAPTER_CONFIG))


def read_adapter_config(path: str) -> dict:
    """``adapter_config.json`` of ``path`` (JSON only: nothing runs)."""
    file = os.path.join(path, ADAPTER_CONFIG)
    try:
        with open(file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{file}: not a readable PEFT adapter config ({err})") from err
    if cfg.get("peft_type") != "LORA" or cfg.get("use_rslora") or cfg.get("use_dora"):
        raise ValueError(f"{file}: a plain LoRA adapter is needed (peft_type LORA, no rsLoRA, no DoRA)")
    return cfg


def load_adapter(model: nn.Module, path: str, copy: Callable[[str, Tensor], None] | None = None) -> None:
    """Read a PEFT adapter (as :func:`save_adapter` writes it) into the model's LoRA factors, which must exist with
    the same rank and alpha and the same targets. ``copy(name, full)`` writes the whole tensor of parameter ``name``
    (default: a plain copy; sharded models need :func:`csattn.parallel.copy_into`). Raises ``ValueError`` naming
    what does not fit: a missing or extra tensor, a shape, r or alpha."""
    from safetensors import safe_open

    cfg = read_adapter_config(path)
    own = dict(model.named_parameters())
    own.update(model.named_buffers())
    copy = copy or (lambda name, full: own[name].detach().copy_(full))
    modules = lora_modules(model)
    if not modules:
        raise ValueError(f"{path}: the model has no LoRA modules to load the adapter into (add_lora first)")
    scale = modules[0][1].lora_scale
    if abs(cfg["lora_alpha"] / cfg["r"] - scale) > 1e-12 * abs(scale):
        raise ValueError(f"{path}: r {cfg['r']} and lora_alpha {cfg['lora_alpha']} give the scale "
                         f"{cfg['lora_alpha'] / cfg['r']}, the model's LoRA has {scale}")
    with safe_open(os.path.join(path, ADAPTER_WEIGHTS), framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    want = adapter_tensors(model, lambda _n, t: torch.empty(0).new_empty(_global_shape(model, _n, t)))
    missing, extra = sorted(set(want) - set(stored)), sorted(set(stored) - set(want))
    if missing or extra:
        raise ValueError(f"{path}: the adapter's tensors do not fit the model's LoRA (missing: {missing[:3]}, "
                         f"unexpected: {extra[:3]}); build the LoRA with the adapter's targets and rank")
    for key, value in stored.items():
        if value.shape != want[key].shape:
            raise ValueError(f"{path}: {key} has shape {tuple(value.shape)}, the model's LoRA "
                             f"{tuple(want[key].shape)}")
    for owner in saved_modules(model):
        for key in model.get_submodule(owner).state_dict():
            copy(f"{owner}.{key}", stored[f"{PREFIX}{owner}.{key}"])
    for name, module in modules:
        if isinstance(module, LoraExperts):
            keys = _expert_keys(name)
            for which in ("gate_up", "down"):
                e = module.num_experts
                a, b, _ = ExpertLora.from_peft(stored[keys[f"lora_A_{which}"]], stored[keys[f"lora_B_{which}"]], e)
                copy(f"{name}.lora_A_{which}", a[module.local.start:module.local.stop])
                copy(f"{name}.lora_B_{which}", b[module.local.start:module.local.stop])
        else:
            copy(f"{name}.lora_A", stored[f"{PREFIX}{name}.lora_A.weight"])
            copy(f"{name}.lora_B", stored[f"{PREFIX}{name}.lora_B.weight"])


def _global_shape(model: nn.Module, name: str, t: Tensor) -> tuple[int, ...]:
    """The whole (all experts, unsharded) shape of parameter ``name``."""
    shape = list(t.shape)
    module = model.get_submodule(name.rpartition(".")[0])
    if isinstance(module, LoraExperts):
        shape[0] = module.num_experts
    return tuple(shape)


def merged_state_dict(model: nn.Module, gather: Gather = _whole) -> dict[str, Tensor]:
    """The model's ``state_dict`` (whole tensors, on the CPU) with every LoRA delta merged into its base weight and
    the factors left out (:func:`merge_lora`)."""
    modules = lora_modules(model)
    state = {name: gather(name, t).cpu() for name, t in model.state_dict().items()}
    return merge_lora(state, modules[0][1].lora_scale) if modules else state


def merge_lora(state: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """``state`` (whole tensors by model name, e.g. one FSDP unit's) with each adapted weight replaced by
    ``W + scale * B @ A`` (per expert for the routed experts) and the factors dropped. Summed in fp32 (fp64 for
    fp64) and rounded once to W's dtype. Every FP8-held weight (``<name>`` e4m3 beside ``<name>_scale_inv``) is
    written dequantized to bf16, adapted or not: a delta merged into FP8 would mostly round away, and the merged
    model is one bf16 checkpoint (its config carries no ``quantization_config``: :func:`merged_config`)."""
    out = {k: v for k, v in state.items() if not any(p.startswith("lora_") for p in k.split("."))}
    for key in [k for k in out if k.endswith(SCALE_SUFFIX)]:
        base = key[:-len(SCALE_SUFFIX)]
        out[base] = dequantize(out[base], out.pop(key), torch.bfloat16)
    for key, a in state.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "lora_A":
            pairs = {"weight": (a, state[f"{module}.lora_B"])}
        elif leaf == "lora_A_gate_up":
            pairs = {"gate_up_proj": (a, state[f"{module}.lora_B_gate_up"]),
                     "down_proj": (state[f"{module}.lora_A_down"], state[f"{module}.lora_B_down"])}
        else:
            continue
        for pname, (fa, fb) in pairs.items():
            w = out[f"{module}.{pname}"]
            c = torch.promote_types(fa.dtype, torch.float32)
            delta = scale * torch.matmul(fb.to(c), fa.to(c))
            out[f"{module}.{pname}"] = (w.to(c) + delta).to(w.dtype)
    return out


def merged_config(config: dict) -> dict:
    """The ``config.json`` of a merged export (:func:`merge_lora`): ``config`` without its
    ``quantization_config``, the weights being bf16."""
    return {k: v for k, v in config.items() if k != "quantization_config"}
