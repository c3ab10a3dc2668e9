"""What an HF-format checkpoint directory holds and how one tensor of it is read: its files (``config.json``,
``model.safetensors`` or shards listed by ``model.safetensors.index.json``), the tensors' names and files, which
scale goes with which weight, where each loadable unit (a tensor, or one routed expert's matrix in a fused HF
tensor) lies on disk, and one tensor read as stored, dequantized, or held in FP8 (MXFP4 converted exactly), with
the checks a tensor read from disk gets before the model trusts it. :mod:`.checkpoint` builds the model and loads it
from these."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .names import _EXPERT, internal_name
from .quant import (
    FP8_BLOCK,
    QuantConfig,
    decode_scale,
    dequantize_fp8,
    dequantize_mxfp4,
    is_fp4_packed,
    is_fp8,
    mxfp4_to_fp8,
)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def read_config(path: str) -> dict[str, Any]:
    """The ``config.json`` of an HF-format directory as a dict."""
    file = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(file):
        raise ValueError(f"path {path!r} has no {CONFIG_NAME}")
    with open(file) as f:
        return json.load(f)


def unreadable(file: str, err: Exception, key: str | None = None) -> ValueError:
    """safetensors' own error on a truncated or damaged file, as one that names the file (and tensor)."""
    what = f"tensor {key!r} of {file!r}" if key else repr(file)
    return ValueError(f"cannot read {what}: {err}. The file is truncated or damaged (an interrupted download, copy "
                      "or save?): fetch or save it again")


def check_values(name: str, where: str, value: Tensor, dest: Tensor, num_experts: int) -> None:
    """What can be checked of tensor ``name`` read from disk (``where`` says which file and key) before the model
    trusts it: a number kind the parameter holds, hash-routing expert ids in range (a damaged table would index
    past the experts deep inside the MoE) and, once copied into ``dest``, finite values. One pass over the tensor,
    by slices (no full-size temporary)."""
    if value.is_floating_point() != dest.is_floating_point():
        raise ValueError(f"tensor {name!r} ({where}) is {value.dtype} on disk but the model holds {dest.dtype}: "
                         "the file is damaged or was written for another model")
    if name.endswith("tid2eid"):
        if value.numel():
            lo, hi = torch.stack(torch.aminmax(value.long())).tolist()
            if lo < 0 or hi >= num_experts:
                raise ValueError(f"hash-routing table {name!r} ({where}) holds expert ids in [{lo}, {hi}] but the "
                                 f"model has {num_experts} routed experts: the file is damaged, or config.json's "
                                 "n_routed_experts does not match it")
        return
    if dest.is_floating_point():
        bad = sum(int((~torch.isfinite(part)).sum()) for part in dest.detach().reshape(-1).split(1 << 24))
        if bad:
            raise ValueError(f"tensor {name!r} ({where}) holds {bad} non-finite values (NaN / Inf) once read as "
                             f"{dest.dtype}: the file is damaged, it was saved from a diverged run, or its values "
                             f"exceed {dest.dtype}'s range")


class Shards:
    """Lazily opened safetensors files of one directory (each opened once; only the ones asked for)."""

    def __init__(self, path: str) -> None:
        self.path, self.handles, self.opened = path, {}, []

    def get(self, file: str) -> Any:
        if file not in self.handles:
            import safetensors

            full = os.path.join(self.path, file)
            try:
                self.handles[file] = safetensors.safe_open(full, framework="pt")
            except safetensors.SafetensorError as err:
                raise unreadable(full, err) from None
            self.opened.append(file)
        return self.handles[file]


def list_keys(path: str, shards: Shards) -> dict[str, str]:
    """Every tensor name on disk -> its file: from ``model.safetensors.index.json`` when there is one (no shard
    is opened), else from the file headers."""
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object")
        for file in set(weight_map.values()):
            if not os.path.isfile(os.path.join(path, file)):
                raise ValueError(f"{index} lists shard {file!r}, which is not in {path!r}")
        return dict(weight_map)
    if os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
        files = [WEIGHTS_NAME]
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"path {path!r} has no .safetensors files")
    out: dict[str, str] = {}
    for file in files:
        for key in shards.get(file).keys():
            out[key] = file
    return out


def split_scales(keys: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """Data tensors and ``{weight key: scale key}``: ``X.weight_scale_inv`` / ``X_scale_inv`` (HF) and ``X.scale``
    next to an ``X.weight`` (reference; ``attn_hc.scale`` & co. have no ``.weight`` beside them, so they stay data)."""
    keyset = set(keys)
    data, scales = [], {}
    for k in keyset:
        if k.endswith("_scale_inv"):
            w = k[: -len("_scale_inv")]
        elif k.endswith(".scale") and k[: -len("scale")] + "weight" in keyset:
            w = k[: -len("scale")] + "weight"
        else:
            data.append(k)
            continue
        if w not in keyset:
            raise ValueError(f"checkpoint has scale {k!r} but not the weight {w!r} it scales")
        if w in scales:
            raise ValueError(f"weight {w!r} has two scale companions: {scales[w]!r} and {k!r}")
        scales[w] = k
    return sorted(data), scales


@dataclass
class Source:
    key: str  # on-disk name of the data tensor
    expert: int | None = None  # fused [E, ...] tensor: the expert's row
    half: int | None = None  # fused gate_up_proj: 0 = gate (w1) rows, 1 = up (w3) rows


def units_on_disk(data: list[str], num_experts: int) -> dict[str, Source]:
    """Unit name -> where it is on disk (per-expert matrices, or a row of a fused HF expert tensor)."""
    out: dict[str, Source] = {}

    def put(unit: str, src: Source) -> None:
        if unit in out:
            raise ValueError(f"tensors {out[unit].key!r} and {src.key!r} both map to {unit!r}")
        out[unit] = src

    for key in data:
        new = internal_name(key)
        if new.endswith("mlp.experts.gate_up_proj"):
            base = new[: -len(".gate_up_proj")]
            for e in range(num_experts):
                put(f"{base}.{e}.w1.weight", Source(key, e, 0))
                put(f"{base}.{e}.w3.weight", Source(key, e, 1))
        elif new.endswith("mlp.experts.down_proj"):
            base = new[: -len(".down_proj")]
            for e in range(num_experts):
                put(f"{base}.{e}.w2.weight", Source(key, e, None))
        else:
            put(new, Source(key))
    return out


def get_tensor(shards: Shards, files: Mapping[str, str], key: str, expert: int | None) -> Tensor:
    """Tensor ``key`` as stored (of a fused expert tensor, only row ``expert`` is read)."""
    from safetensors import SafetensorError

    f = shards.get(files[key])
    try:
        if expert is None:
            return f.get_tensor(key)
        sl = f.get_slice(key)
        shape = sl.get_shape()
        if len(shape) < 1 or shape[0] <= expert:
            raise ValueError(f"tensor {key!r} has shape {tuple(shape)}: no row for expert {expert}")
        return sl[expert: expert + 1][0]
    except SafetensorError as err:
        raise unreadable(os.path.join(shards.path, files[key]), err, key) from None


def read_tensor(shards: Shards, files: Mapping[str, str], src: Source, scale_key: str | None,
          quant: QuantConfig | None, dtype: torch.dtype, is_expert: bool,
          device: torch.device | str | None = None) -> tuple[Tensor, bool]:
    """One tensor (a fused expert tensor: expert ``src.expert``'s row), dequantized to ``dtype`` when quantized;
    a quantized one is moved to ``device`` first (default: where it was read) and dequantized there."""

    def get(key: str) -> Tensor:
        t = get_tensor(shards, files, key, src.expert)
        return t if device is None or scale_key is None else t.to(device)

    t = get(src.key)
    if scale_key is None:
        if is_fp8(t):
            raise ValueError(f"tensor {src.key!r} is {t.dtype} but the checkpoint has no scale for it "
                             f"({src.key[:-len('weight')] + 'scale' if src.key.endswith('weight') else src.key}"
                             " or *_scale_inv)")
        return t, False
    if quant is None:
        raise ValueError(f"tensor {src.key!r} has a scale ({scale_key!r}) but config.json has no "
                         "quantization_config; add the release's (quant_method 'fp8', weight_block_size)")
    s = get(scale_key)
    if is_fp8(t):
        if is_expert and quant.expert_dtype == "fp4":
            raise ValueError(f"config.json expert_dtype is 'fp4' but expert tensor {src.key!r} is FP8; set "
                             "expert_dtype to 'fp8'")
        bn = quant.block_size[0]
        rows = t.shape[-2]
        if src.half is not None and s.shape[-2] != -(-rows // bn) and s.shape[-2] == 2 * -(-(rows // 2) // bn):
            # a fused gate_up_proj concatenated from per-expert gate and up matrices keeps each half's own
            # (ragged) block rows
            g, u = t.chunk(2, dim=-2)
            sg, su = s.chunk(2, dim=-2)
            return torch.cat([dequantize_fp8(g, sg, quant.block_size, dtype, src.key),
                              dequantize_fp8(u, su, quant.block_size, dtype, src.key)], dim=-2), True
        return dequantize_fp8(t, s, quant.block_size, dtype, src.key), True
    if is_fp4_packed(t):
        if not is_expert or quant.expert_dtype != "fp4":
            raise ValueError(f"tensor {src.key!r} is packed FP4 ({t.dtype}) but "
                             + ("it is not a routed expert" if not is_expert else "config.json expert_dtype is "
                                f"{quant.expert_dtype!r}; set it to 'fp4'"))
        return dequantize_mxfp4(t, s, dtype, src.key), True
    raise ValueError(f"tensor {src.key!r} has a scale ({scale_key!r}) but dtype {t.dtype}, neither FP8 e4m3 nor "
                     "packed FP4")


def read_held(shards: Shards, files: Mapping[str, str], srcs: list[Source], scales: Mapping[str, str],
               quant: QuantConfig | None, name: str,
               device: torch.device | str | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """One FP8-held matrix as stored, never dequantized: ``(e4m3 [N, K], fp32 block scales, inexact blocks or
    None)``. ``srcs``: a dense linear's weight, an expert's ``w2``, or its ``w1`` and ``w3`` (stacked as the
    ``gate_up_proj`` row; one fused HF row is read once). MXFP4 is moved to ``device`` (default: where it was
    read) and converted there by :func:`mxfp4_to_fp8`."""
    if len(srcs) == 2 and (srcs[0].key, srcs[0].expert) == (srcs[1].key, srcs[1].expert):
        srcs = srcs[:1]  # a fused gate_up_proj row holds both halves
    data, scale = [], []
    for src in srcs:
        key = scales.get(src.key)
        if key is None or quant is None:
            raise ValueError(f"tensor {src.key!r} is not quantized (no scale or no quantization_config): "
                             "base_precision 'fp8' / 'w8a16' holds the FP8 / MXFP4 tensors of a release checkpoint "
                             "as they are; load this checkpoint with base_precision='bf16'")
        data.append(get_tensor(shards, files, src.key, src.expert))
        scale.append(get_tensor(shards, files, key, src.expert))
    t, s = (data[0], scale[0]) if len(data) == 1 else (torch.cat(data), torch.cat(scale))
    if is_fp4_packed(t):
        if quant.expert_dtype != "fp4":
            raise ValueError(f"tensor {srcs[0].key!r} is packed FP4 but config.json expert_dtype is "
                             f"{quant.expert_dtype!r}; set it to 'fp4'")
        if device is not None:
            t, s = t.to(device), s.to(device)
        return mxfp4_to_fp8(t, s, srcs[0].key)
    if not is_fp8(t):
        raise ValueError(f"tensor {srcs[0].key!r} has a scale but dtype {t.dtype}, neither FP8 e4m3 nor packed FP4")
    if quant.block_size != (FP8_BLOCK, FP8_BLOCK):
        raise ValueError(f"config.json quantization_config.weight_block_size is {list(quant.block_size)}: FP8-held "
                         f"weights take [{FP8_BLOCK}, {FP8_BLOCK}] blocks (the release's); load with "
                         "base_precision='bf16'")
    want = (-(-t.shape[0] // FP8_BLOCK), -(-t.shape[1] // FP8_BLOCK))
    if tuple(s.shape) != want:
        raise ValueError(f"tensor {name!r} (on disk {srcs[0].key!r}): scales {tuple(s.shape)} do not tile the "
                         f"{tuple(t.shape)} weight as one {want} grid of {FP8_BLOCK}x{FP8_BLOCK} blocks (gate and up "
                         "halves of a moe_intermediate_size that is not a multiple of 128 each have a ragged block "
                         "row); load with base_precision='bf16'")
    return t, decode_scale(s, srcs[0].key), None


def check_held(name: str, where: str, q: Tensor, s: Tensor) -> None:
    """An FP8-held matrix read from disk: no e4m3 NaN code (``0x7F`` / ``0xFF``), finite positive scales."""
    nan = int(((q.view(torch.uint8) & 0x7F) == 0x7F).sum())
    bad = int((~torch.isfinite(s) | (s <= 0)).sum())
    if nan or bad:
        raise ValueError(f"tensor {name!r} ({where}) holds {nan} NaN codes and {bad} non-finite or non-positive "
                         "scales: the file is damaged")


def quantized_linears(data: list[str], scales: Mapping[str, str]) -> list[str]:
    """Module names of the dense linears the checkpoint stores quantized (a scale beside the weight)."""
    out = []
    for key in data:
        name = internal_name(key)
        if key in scales and name.endswith(".weight") and not _EXPERT.match(name) and ".mlp.experts." not in name:
            out.append(name[: -len(".weight")])
    return out
