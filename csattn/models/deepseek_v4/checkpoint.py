"""HF-format checkpoints in and out: ``config.json`` + ``model.safetensors`` (or sharded with
``model.safetensors.index.json``); :mod:`.disk` reads what is there, this module builds the model and loads it.
On disk the tensors carry the DeepSeek reference names that the release and ``transformers``' ``save_pretrained``
use; ``names.py`` maps them to this model's ``state_dict`` names (equal to ``transformers.DeepseekV4ForCausalLM``'s).
MTP blocks, which ``transformers`` skips on load, are stored under ``mtp.{j}.``."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ...layers.modules import RMSNorm
from .config import DeepseekV4ModelConfig
from .disk import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    Shards,
    Source,
    check_held,
    check_values,
    list_keys,
    quantized_linears,
    read_config,
    read_held,
    read_tensor,
    split_scales,
    units_on_disk,
    unreadable,
)
from .mhc import HyperHead
from .model import DecoderLayer, DeepseekV4ForCausalLM, MTPBlock
from .names import _EXPERT, _disk_name, internal_name, to_disk, to_internal
from .quant import COMPUTES, FP8_BLOCK, Fp8Experts, Fp8Linear, QuantConfig, hold_in_fp8

__all__ = ["load_pretrained", "save_pretrained", "load_state_dict_into", "read_safetensors", "read_config",
           "LoadReport", "experts_filter", "BASE_PRECISIONS", "held_linears", "inexact_fp8_message", "hf_config"]

# "bf16": quantized weights dequantized to the training dtype; "fp8" / "w8a16": routed experts (and optionally the
# dense linears) held as FP8 in memory, computed on FP8 tensor cores / with bf16 numerics (quant.Fp8Experts)
BASE_PRECISIONS = ("bf16", *COMPUTES)


def read_safetensors(path: str) -> dict[str, Tensor]:
    """All tensors of the directory (single file or sharded via the index), renamed to ``state_dict`` names."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    shards = sorted(set(list_keys(path, Shards(path)).values()))  # the files load_pretrained would read
    tensors: dict[str, Tensor] = {}
    for shard in shards:
        try:
            tensors.update(load_file(os.path.join(path, shard)))
        except SafetensorError as err:
            raise unreadable(os.path.join(path, shard), err) from None
    return to_internal(tensors)


def load_state_dict_into(model: DeepseekV4ForCausalLM, tensors: Mapping[str, Tensor],
                         allow_missing_prefixes: tuple[str, ...] = ()) -> None:
    """Copy ``tensors`` into ``model`` (casting to each parameter's dtype).

    Raises ``ValueError`` naming the tensor when one is missing (unless under ``allow_missing_prefixes``),
    unexpected, or shaped differently from the model's config.
    """
    own = model.state_dict()
    tied = model.config.tie_word_embeddings
    missing = [k for k in own if k not in tensors and not k.startswith(allow_missing_prefixes)
               and not (tied and k == "lm_head.weight")]
    unexpected = [k for k in tensors if k not in own]
    if missing:
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r} (on disk {_disk_name(missing[0])!r}; "
                         f"{len(missing)} missing in all: {missing[:8]})")
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensor {unexpected[0]!r} (on disk "
                         f"{_disk_name(unexpected[0])!r}; {len(unexpected)} in all: {unexpected[:8]}); does its "
                         "config match the model's?")
    for name, tensor in tensors.items():
        if tuple(own[name].shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name!r} (on disk {_disk_name(name)!r}) has shape {tuple(tensor.shape)} in "
                             f"the checkpoint but the config gives {tuple(own[name].shape)}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            own[name].copy_(tensor)
            check_values(name, f"on disk {_disk_name(name)!r}", tensor, own[name], model.config.n_routed_experts)


@dataclass
class LoadReport:
    """What :func:`load_pretrained` put into the model (``model.load_report``).

    Attributes:
        layers: decoder layers built with real storage (the others are on the meta device).
        mtp: MTP blocks built with real storage.
        top: top-level modules built (``embed_tokens``, ``norm``, ``hc_head``, ``lm_head``).
        loaded: tensors read from disk (``state_dict`` names; one routed-expert matrix as
            ``model.layers.{i}.mlp.experts.{e}.w1.weight`` / ``w3`` (gate / up rows of ``gate_up_proj[e]``) /
            ``w2`` (``down_proj[e]``)).
        skipped: tensors of built modules that ``filter`` rejected: left at their fresh init, not read.
        fresh: MTP tensors absent from the checkpoint (``mtp=True``): fresh init.
        dequantized: how many of ``loaded`` were FP8 / MXFP4 on disk.
        shards: the safetensors files opened.
        fp8: FP8-held matrices read (``base_precision="fp8"`` / ``"w8a16"``; a gate / up pair counts once).
        fp8_inexact: MXFP4 expert matrices that e4m3 with power-of-two 128x128 block scales could not hold
            exactly -> their number of rounded blocks (``"model.layers.{i}.mlp.experts.gate_up_proj[e]"``).
    """

    layers: list[int] = field(default_factory=list)
    mtp: list[int] = field(default_factory=list)
    top: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    fresh: list[str] = field(default_factory=list)
    dequantized: int = 0
    shards: list[str] = field(default_factory=list)
    fp8: int = 0
    fp8_inexact: dict[str, int] = field(default_factory=dict)


def experts_filter(experts: Iterable[int]) -> Callable[[str], bool]:
    """A ``filter=`` for :func:`load_pretrained` on an expert-parallel rank: every tensor except the routed experts
    not in ``experts`` (e.g. ``range(rank * 64, rank * 64 + 64)``)."""
    keep = {int(e) for e in experts}

    def accept(name: str) -> bool:
        m = _EXPERT.match(name)
        return m is None or int(m.group(2)) in keep

    return accept


def _part(name: str) -> tuple[str, Any]:
    """Which module a ``state_dict`` name lives in: ("layer", i), ("mtp", j) or ("top", module)."""
    p = name.split(".")
    if p[0] == "model" and p[1] == "layers":
        return "layer", int(p[2])
    if p[0] == "mtp":
        return "mtp", int(p[1])
    return "top", p[1] if p[0] == "model" else p[0]


def _units(own: Mapping[str, Tensor], num_experts: int,
           experts: range | None = None) -> dict[str, tuple[str, int | None, int | None]]:
    """Loadable units of the model -> (parameter, expert, half): one per tensor, one per routed-expert matrix.
    ``experts``: the global ids the model's expert tensors hold (an expert-parallel rank's share; default all);
    ``expert`` is then the row in the local tensor."""
    out: dict[str, tuple[str, int | None, int | None]] = {}
    held = range(num_experts) if experts is None else experts
    for name in own:
        if name.endswith("_scale_inv"):  # an FP8-held tensor's scale: read with its data
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len(".gate_up_proj")]
            for i, e in enumerate(held):
                out[f"{base}.{e}.w1.weight"] = (name, i, 0)
                out[f"{base}.{e}.w3.weight"] = (name, i, 1)
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len(".down_proj")]
            for i, e in enumerate(held):
                out[f"{base}.{e}.w2.weight"] = (name, i, None)
        else:
            out[name] = (name, None, None)
    return out


def _load_held(model: DeepseekV4ForCausalLM, units: Mapping[str, tuple[str, int | None, int | None]],
               wanted: list[str], sources: Mapping[str, Source], files: Mapping[str, str], shards: Shards,
               scales: Mapping[str, str], quant: QuantConfig | None, report: LoadReport,
               device: torch.device | str | None = None) -> None:
    """Read the FP8-held matrices among ``wanted`` into the model as they are stored (MXFP4 converted on
    ``device``), one matrix at a time: one expert's ``gate_up_proj`` / ``down_proj`` row, or a dense linear."""
    own = model.state_dict(keep_vars=True)
    groups: dict[tuple[str, int | None], list[str]] = {}
    for unit in wanted:
        param, e, _ = units[unit]
        groups.setdefault((param, e), []).append(unit)
    for (param, e), group in sorted(groups.items(), key=lambda kv: (files[sources[kv[1][0]].key], kv[0][0],
                                                                    kv[0][1] or 0)):
        group.sort(key=lambda u: units[u][2] or 0)  # gate (w1) before up (w3)
        if param.endswith("gate_up_proj") and len(group) != 2:
            raise ValueError(f"FP8-held experts load gate and up together: filter= accepts {group} but not its "
                             "pair")
        srcs = [sources[u] for u in group]
        label = param if e is None else f"{param}[{_expert_id(model, param, e)}]"
        q, s, inexact = read_held(shards, files, srcs, scales, quant, label, device)
        dest, dest_scale = own[param], own[param + "_scale_inv"]
        if e is not None:
            dest, dest_scale = dest[e], dest_scale[e]
        if tuple(q.shape) != tuple(dest.shape) or tuple(s.shape) != tuple(dest_scale.shape):
            raise ValueError(f"tensor {label!r} (on disk {srcs[0].key!r}) has shape {tuple(q.shape)} in the "
                             f"checkpoint but the config gives {tuple(dest.shape)}")
        # checked where it was converted (the device's: a pass over the matrix there costs nothing), then copied
        check_held(label, f"{srcs[0].key!r} in {files[srcs[0].key]!r}", q, s)
        with torch.no_grad():
            dest.copy_(q)
            dest_scale.copy_(s)
        if inexact is not None and bool(inexact.any()):
            report.fp8_inexact[label] = int(inexact.sum())
        report.loaded.extend(group)
        report.fp8 += 1


def _expert_id(model: DeepseekV4ForCausalLM, param: str, row: int) -> int:
    """The global id of row ``row`` of expert tensor ``param`` (an expert-parallel model holds a share)."""
    return model.get_submodule(param.rsplit(".", 1)[0]).local[row]


def held_linears(path: str) -> list[str]:
    """Module names of the dense linears the checkpoint at ``path`` stores in FP8 (what ``fp8_linears=True`` holds;
    for ``quant.hold_in_fp8`` on a model built on the meta device). Reads the index or the file headers only."""
    return quantized_linears(*split_scales(list_keys(path, Shards(path))))


def _linears_to_hold(asked: bool | Iterable[str], stored: list[str]) -> list[str]:
    """The dense linears ``fp8_linears=`` holds: all the checkpoint stores in FP8 (True), none (False), or the
    named ones, each of which it must store in FP8."""
    if isinstance(asked, bool):
        return stored if asked else []
    names = list(asked)
    other = sorted(set(names) - set(stored))
    if other:
        raise ValueError(f"fp8_linears= names {other[:4]}, which the checkpoint does not store in FP8")
    return names


def _select_layers(layers: Iterable[int] | None, n: int) -> list[int]:
    if layers is None:
        return list(range(n))
    out = sorted({int(i) for i in layers})
    bad = [i for i in out if not 0 <= i < n]
    if bad:
        raise ValueError(f"layers= holds {bad[:8]}, outside the checkpoint's decoder layers 0..{n - 1}")
    return out


def _build(config: DeepseekV4ModelConfig, layers: list[int], mtp: list[int], top: list[str],
           dtype: torch.dtype, experts: range | None = None, held: str | None = None,
           linears: Iterable[str] = ()) -> DeepseekV4ForCausalLM:
    """The model on the meta device with real (freshly initialised, ``dtype``) storage for the chosen parts only;
    each part is built in fp32 and cast before the next, so at most one block is ever held in fp32.

    ``held`` (``"fp8"`` / ``"w8a16"``): the routed experts are FP8-held (:class:`Fp8Experts`, zeros until read):
    a block is built without routed experts (an empty range) and given FP8 ones, so no full-precision copy of its
    experts ever exists; so are the dense ``linears`` (module names), which are built and then replaced."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    model.to_training_dtype(dtype)
    c = config
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    wanted = set(linears)

    def hold(block: DecoderLayer, prefix: str) -> DecoderLayer:
        if held is not None:
            block.mlp.experts = Fp8Experts.like(block.mlp.experts, held, experts or range(c.n_routed_experts))
            hold_in_fp8(block, held, [n[len(prefix):] for n in wanted if n.startswith(prefix)])
        return block

    for i in layers:
        model.model.layers[i] = hold(DecoderLayer(c, i, range(0) if held else experts), f"model.layers.{i}.")
        model.model.layers[i].mlp.gate.init_hash_table(gen)
        model.to_training_dtype(dtype)
    for j in mtp:
        model.mtp[j] = hold(MTPBlock(c, j, range(0) if held else experts), f"mtp.{j}.")
        model.to_training_dtype(dtype)
    # the same modules and init as DeepseekV4ForCausalLM.__init__
    if "embed_tokens" in top:
        model.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, c.pad_token_id)
        nn.init.normal_(model.model.embed_tokens.weight, std=c.initializer_range)
    if "norm" in top:
        model.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
    if "hc_head" in top:
        model.model.hc_head = HyperHead(c.hidden_size, c.hc_mult, c.hc_eps, c.rms_norm_eps,
                                        backend=c.backend)
    if "lm_head" in top and not c.tie_word_embeddings:
        model.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        nn.init.normal_(model.lm_head.weight, std=c.initializer_range)
    if c.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to_training_dtype(dtype)
    return model


def _other_rank_expert(unit: str, experts: range | None) -> bool:
    """Whether ``unit`` is a routed-expert matrix outside ``experts`` (another expert-parallel rank's)."""
    m = _EXPERT.match(unit) if experts is not None else None
    return m is not None and int(m.group(2)) not in experts


def load_pretrained(path: str, mtp: bool | None = None, dtype: torch.dtype | None = None,
                    layers: Iterable[int] | None = None, filter: Callable[[str], bool] | None = None,
                    experts: range | None = None, base_precision: str = "bf16",
                    fp8_linears: bool | Iterable[str] = False,
                    allow_inexact_fp8: bool = False, convert_device: torch.device | str | None = None,
                    **config_overrides: Any) -> DeepseekV4ForCausalLM:
    """Build :class:`DeepseekV4ForCausalLM` from an HF-format directory, plain or quantized as released.

    Tensors are read one at a time (``safetensors.safe_open``) straight into the model's parameters, already in
    the training dtype; FP8 / MXFP4 ones (see ``quant.py``) are dequantized on the way, so no full-precision copy
    of the checkpoint is ever held. Only the shards holding wanted tensors are opened (``model.safetensors.index
    .json`` says which).

    Args:
        path: directory with ``config.json`` and safetensors.
        mtp: ``None`` builds the config's MTP blocks only if the checkpoint holds ``mtp.*`` tensors (HF-saved
            checkpoints do not); ``True`` builds them anyway (fresh weights when absent); ``False`` never.
        dtype: training dtype (see ``DeepseekV4ForCausalLM.to_training_dtype``); default fp32.
        layers: decoder layers to build and load (e.g. ``range(10, 20)`` for a pipeline stage); default all. The
            embedding is built with layer 0, the final ``norm`` / ``hc_head`` / ``lm_head`` and the MTP blocks with
            the last layer (and the embedding there too when the LM head is tied to it or MTP blocks, which embed
            the next token, are built). Everything else stays on the meta device: no storage, not read; the layer
            indices (``model.model.layers[i]``) are the checkpoint's.
        filter: ``filter(name) -> bool`` on ``state_dict`` names (a routed expert matrix as
            ``model.layers.{i}.mlp.experts.{e}.w1.weight`` / ``w3`` / ``w2``; see :func:`experts_filter`): the
            tensors of built modules that it rejects are not read and keep their fresh init (listed in
            ``model.load_report.skipped``; FP8-held experts have none: they stay zero, and their gate and up
            matrices are accepted or rejected together).
        experts: the routed experts to build and read (global ids, e.g. an expert-parallel rank's
            ``range(r * E / ep, (r + 1) * E / ep)``); each layer's expert tensors then hold only these, in order.
            Default all.
        base_precision: ``"bf16"``: quantized tensors are dequantized to ``dtype`` (whatever it is).
            ``"fp8"`` / ``"w8a16"``: the routed experts stay FP8 in memory, frozen (:class:`~.quant.Fp8Experts`,
            computed on FP8 tensor cores / with bf16 numerics): FP8 ones as stored, MXFP4 ones converted exactly
            (:func:`~.quant.mxfp4_to_fp8`), one expert matrix at a time, never a full-precision copy. Needs a
            quantized release checkpoint (``[128, 128]`` FP8 blocks where FP8 tensors are kept).
        fp8_linears: with ``"fp8"`` / ``"w8a16"``, also hold the dense linears the checkpoint stores in FP8
            (attention projections, shared experts, MTP projections) as frozen :class:`~.quant.Fp8Linear`. Off by
            default: the routed experts are nearly all of the weight bytes, the dense layers are the ones a
            fine-tune trains (or adapts: LoRA beside a frozen bf16 base merges exactly), and the attention core
            reads ``q_b_proj`` / ``o_a_proj`` / ``o_b_proj`` whole, so FP8 there dequantizes a copy every call.
            Module names instead of True: only those (each one the checkpoint stores in FP8).
        allow_inexact_fp8: MXFP4 blocks that e4m3 with one power-of-two scale per 128x128 block cannot hold
            exactly (group scales about ``2**14`` apart) are counted in ``load_report.fp8_inexact``; the load then
            fails naming them, unless this is True (their small values then round to nearest e4m3).
        convert_device: where each quantized tensor is dequantized or converted (MXFP4 -> FP8), one at a time,
            before it is copied into the model (on the CPU): a GPU does a full-width expert matrix in milliseconds,
            the host in seconds. The same values on any device. Default: the CPU.
        config_overrides: fields of :class:`DeepseekV4ModelConfig` (e.g. ``indexer_loss_coeff``).

    Returns:
        The model, with ``model.load_report`` (:class:`LoadReport`) saying what was built, read and skipped.

    Raises:
        ValueError: naming the tensor / field, for a missing, unexpected or misshaped tensor, a scale whose shape
            does not fit its weight, a ``quantization_config`` this loader cannot read; naming the file (and
            tensor) for a truncated or damaged safetensors file, a tensor of the wrong number kind, hash-routing
            expert ids out of range or non-finite weights.
    """
    held = _held_precision(base_precision, fp8_linears)
    disk = _Disk.open(path, held)
    config = _config(path, disk, mtp, config_overrides)
    n_exp = config.n_routed_experts
    if experts is not None and (experts.step != 1 or experts.start < 0 or experts.stop > n_exp):
        raise ValueError(f"experts={experts} must be a contiguous range inside the checkpoint's {n_exp} experts")
    sel, sel_mtp, top = _parts(config, layers)
    model = _build(config, sel, sel_mtp, top, dtype or torch.float32, experts, held,
                   _linears_to_hold(fp8_linears, quantized_linears(disk.data, disk.scales)))
    own = model.state_dict(keep_vars=True)
    units = _units(own, n_exp, experts)
    with_mtp = disk.has_mtp and config.num_nextn_predict_layers
    sources = units_on_disk([k for k in disk.data if with_mtp or not internal_name(k).startswith("mtp.")], n_exp)
    unexpected = [u for u in sources if u not in units and not _other_rank_expert(u, experts)]
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensor {unexpected[0]!r} (on disk "
                         f"{sources[unexpected[0]].key!r}; {len(unexpected)} in all: {unexpected[:8]}); does its "
                         "config match the model's?")
    report = LoadReport(layers=sel, mtp=sel_mtp, top=top)
    wanted = _wanted(units, sources, config, {("layer", i) for i in sel} | {("mtp", j) for j in sel_mtp}
                     | {("top", t) for t in top}, filter, disk.has_mtp, report)
    frozen = {f"{prefix}.{n}" for prefix, m in model.named_modules() if isinstance(m, (Fp8Experts, Fp8Linear))
              for n in m.frozen_storage if not n.endswith("_scale_inv")}
    _load_held(model, units, [u for u in wanted if units[u][0] in frozen], sources, disk.files, disk.shards,
               disk.scales, disk.quant, report, convert_device)
    _copy_units(own, units, sources, [u for u in wanted if units[u][0] not in frozen], disk, report, n_exp,
                convert_device)
    report.shards = list(disk.shards.opened)
    model.load_report = report
    if report.fp8_inexact and not allow_inexact_fp8:
        raise ValueError(inexact_fp8_message(report.fp8_inexact))
    return model


def _held_precision(base_precision: str, fp8_linears: bool | Iterable[str]) -> str | None:
    """``base_precision`` checked: ``None`` for ``"bf16"`` (everything dequantized), else how FP8 is held."""
    if base_precision not in BASE_PRECISIONS:
        raise ValueError(f"base_precision must be one of {BASE_PRECISIONS}, got {base_precision!r}")
    held = None if base_precision == "bf16" else base_precision
    if fp8_linears and held is None:
        raise ValueError("fp8_linears=True holds the dense linears in FP8: it needs base_precision 'fp8' or 'w8a16'")
    return held


@dataclass
class _Disk:
    """What a checkpoint directory holds: its ``config.json``, its quantization, its shards (opened lazily),
    every tensor's file, the data tensors and ``{weight key: scale key}``, and whether it holds MTP blocks."""

    raw: dict[str, Any]
    quant: QuantConfig | None
    shards: Shards
    files: dict[str, str]
    data: list[str]
    scales: dict[str, str]
    has_mtp: bool

    @staticmethod
    def open(path: str, held: str | None) -> _Disk:
        raw = read_config(path)
        quant = QuantConfig.from_config(raw)
        if held is not None and quant is None:
            raise ValueError(f"base_precision={held!r} keeps a release checkpoint's FP8 / MXFP4 weights as they "
                             f"are, but {path!r} has no quantization_config: load it with base_precision='bf16'")
        shards = Shards(path)
        files = list_keys(path, shards)
        data, scales = split_scales(files)
        has_mtp = any(internal_name(k).startswith("mtp.") for k in data)
        return _Disk(raw, quant, shards, files, data, scales, has_mtp)


def _config(path: str, disk: _Disk, mtp: bool | None, overrides: dict[str, Any]) -> DeepseekV4ModelConfig:
    """The model's config: ``config.json`` with ``overrides``, and the MTP blocks ``mtp`` asks for (``None``: those
    the checkpoint holds; a warning where it asks for blocks the checkpoint does not hold)."""
    n_mtp = int(disk.raw.get("num_nextn_predict_layers", 0) or 0)
    if mtp is False or (mtp is None and not disk.has_mtp):
        n_mtp = 0
    overrides.setdefault("num_nextn_predict_layers", n_mtp)
    config = DeepseekV4ModelConfig.from_hf(disk.raw, **overrides)
    n_mtp = config.num_nextn_predict_layers
    if mtp and not disk.has_mtp and n_mtp:
        warnings.warn(f"{path}: no mtp.* tensors; the {n_mtp} MTP block(s) start from fresh weights", stacklevel=3)
    return config


def _parts(config: DeepseekV4ModelConfig, layers: Iterable[int] | None) -> tuple[list[int], list[int], list[str]]:
    """The decoder layers, MTP blocks and top-level modules to build (see ``load_pretrained``'s ``layers``)."""
    n = config.num_hidden_layers
    sel = _select_layers(layers, n)
    last = layers is None or (n - 1) in sel
    sel_mtp = list(range(config.num_nextn_predict_layers)) if last else []
    top = (["embed_tokens"] if layers is None or 0 in sel or (last and (config.tie_word_embeddings or sel_mtp))
           else []) + (["norm", "hc_head", "lm_head"] if last else [])
    return sel, sel_mtp, top


def _wanted(units: Mapping[str, tuple[str, int | None, int | None]], sources: Mapping[str, Source],
            config: DeepseekV4ModelConfig, built: set[tuple[str, Any]], filter: Callable[[str], bool] | None,
            has_mtp: bool, report: LoadReport) -> list[str]:
    """The units of the ``built`` parts to read; the ones ``filter`` rejects go to ``report.skipped``, MTP ones a
    checkpoint without MTP blocks lacks to ``report.fresh``; a missing one is an error."""
    wanted: list[str] = []
    for unit, (param, _, _) in units.items():
        if _part(param) not in built or (config.tie_word_embeddings and param == "lm_head.weight"):
            continue
        if filter is not None and not filter(unit):
            report.skipped.append(unit)
        elif unit in sources:
            wanted.append(unit)
        elif unit.startswith("mtp.") and not has_mtp:
            report.fresh.append(unit)
        else:
            raise ValueError(f"checkpoint is missing tensor {unit!r} (on disk {_disk_name(unit)!r})")
    return wanted


def _copy_units(own: Mapping[str, Tensor], units: Mapping[str, tuple[str, int | None, int | None]],
                sources: Mapping[str, Source], wanted: list[str], disk: _Disk, report: LoadReport, n_exp: int,
                device: torch.device | str | None) -> None:
    """Read each of ``wanted`` (dequantized on ``device`` where quantized) into its parameter, checked, shard by
    shard so that each file is visited once (a scale stored in another shard opens that one too)."""
    wanted = sorted(wanted, key=lambda u: (disk.files[sources[u].key], sources[u].key, sources[u].expert or 0))
    last_read: tuple[tuple[str, int | None, torch.dtype], tuple[Tensor, bool]] | None = None
    with torch.no_grad():
        for unit in wanted:
            src = sources[unit]
            param, e, half = units[unit]
            dest = own[param]
            if e is not None:
                dest = dest[e]
                if half is not None:
                    dest = dest.chunk(2, dim=0)[half]
            if last_read is not None and last_read[0] == (src.key, src.expert, dest.dtype):
                value, deq = last_read[1]  # the other half of a fused gate_up_proj row: read once
            else:
                value, deq = read_tensor(disk.shards, disk.files, src, disk.scales.get(src.key), disk.quant,
                                         dest.dtype, e is not None, device)
                last_read = ((src.key, src.expert, dest.dtype), (value, deq))
            if src.half is not None:
                if value.shape[0] % 2:
                    raise ValueError(f"tensor {src.key!r}: fused gate_up_proj rows {value.shape[0]} are odd")
                value = value.chunk(2, dim=0)[src.half]
            if tuple(value.shape) != tuple(dest.shape):
                raise ValueError(f"tensor {unit!r} (on disk {src.key!r}) has shape {tuple(value.shape)} in the "
                                 f"checkpoint but the config gives {tuple(dest.shape)}")
            dest.copy_(value)
            check_values(unit, f"{src.key!r} in {disk.files[src.key]!r}", value, dest, n_exp)
            report.loaded.append(unit)
            report.dequantized += int(deq)


def inexact_fp8_message(inexact: Mapping[str, int]) -> str:
    """The refusal of a load with MXFP4 blocks that FP8 cannot hold exactly (``LoadReport.fp8_inexact``)."""
    some = ", ".join(f"{k}: {v}" for k, v in list(inexact.items())[:8])
    return (f"{sum(inexact.values())} MXFP4 blocks of {len(inexact)} expert matrices cannot be held exactly as e4m3 "
            f"with one power-of-two scale per 128x128 block ({some}): their group scales lie too far apart. Pass "
            "allow_inexact_fp8=True (--allow-inexact-fp8) to round their small values to nearest e4m3, or load "
            "with base_precision='bf16' (exact dequantization)")


def hf_config(model: DeepseekV4ForCausalLM) -> dict[str, Any]:
    """The ``config.json`` of ``model`` as written: its HF config, its MTP blocks and, when it holds FP8 weights,
    the ``quantization_config`` they are written in (e4m3, fp32 128x128 block scales, FP8 experts)."""
    cfg = model.config.to_hf_dict()
    cfg["num_nextn_predict_layers"] = len(model.mtp)
    if any(isinstance(m, (Fp8Experts, Fp8Linear)) for m in model.modules()):
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [FP8_BLOCK] * 2,
                                      "activation_scheme": "dynamic", "scale_fmt": None, "expert_dtype": "fp8"}
    return cfg


def save_pretrained(model: DeepseekV4ForCausalLM, path: str) -> None:
    """Write ``config.json`` and ``model.safetensors`` with the names ``transformers`` writes (tied LM head
    stored once). FP8-held weights are written as held (e4m3 + ``weight_scale_inv``, with a ``quantization_config``);
    ``load_pretrained`` reads them back bit for bit (``base_precision="fp8"``) or dequantized."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    cfg = hf_config(model)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = to_disk(state)
    tmp = os.path.join(path, WEIGHTS_NAME + ".tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, WEIGHTS_NAME))
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
