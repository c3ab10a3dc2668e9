"""Hugging Face's FP8 modules (``transformers.integrations.finegrained_fp8``) on csattn's FP8 ops, for
:func:`csattn.integrations.transformers.patch`.

A ``DeepseekV4ForCausalLM`` loaded from the FP8 release on a GPU (``FineGrainedFP8Config``) holds:

- ``FP8Linear`` / ``FP8GroupedLinear`` (``o_a_proj``): ``weight`` e4m3 ``[N, K]`` and ``weight_scale_inv`` (fp32 or
  ue8m0) ``[ceil(N / 128), ceil(K / 128)]``;
- ``FP8Experts``: ``gate_up_proj`` / ``down_proj`` e4m3 ``[E, N, K]`` with ``<name>_scale_inv`` per 128 x 128
  block, or, with ``expert_dtype="fp4"`` (the release), packed MXFP4 ``int8 [E, N, K / 2]`` with one ue8m0 scale per
  32 values along K.

The patched model runs them as follows, the FP8 codes and their scales frozen (no gradient, as in HF's FP8 layers;
the input, the routing weights and adapters beside them get theirs):

- linears it calls (``q_a_proj``, ``kv_proj``, the shared experts', ...): :func:`csattn.ops.fp8.fp8_linear`;
- projections whose weight the attention reads (``q_b_proj``, ``o_a_proj``, ``o_b_proj``, the indexer's
  ``q_b_proj``): :func:`weight_of` dequantizes them in the model's compute dtype at every read;
- experts: :func:`csattn.ops.moe.moe_experts` with ``gate_up_scale`` / ``down_scale`` (the grouped FP8 GEMMs), LoRA
  per expert through the same GEMMs. MXFP4 experts are converted to FP8 e4m3 with 128 x 128 power-of-two block
  scales at ``patch`` (:func:`csattn.models.deepseek_v4.quant.mxfp4_to_fp8`: exact, blocks it cannot hold exactly
  refused), kept beside the packed tensors (which ``state_dict`` / ``save_pretrained`` still write).

Scales are read in csattn's layout, one fp32 scale per 128 x 128 block: ``weight_block_size`` must be
``[128, 128]`` (the release's); a fused ``gate_up_proj`` whose gate and up halves share a block (``2I < 256``) must
give them the same scale. Other layouts are refused, naming the module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.integrations import finegrained_fp8 as hf_fp8

from ..models.deepseek_v4.quant import _apply_raw, decode_scale, mxfp4_to_fp8
from ..ops.backend import BackendChoice
from ..ops.fp8 import BLOCK, COMPUTES, dequantize, fp8_linear
from ..ops.moe import ExpertLora, moe_experts

__all__ = ["COMPUTES", "PATCHED", "FP8Linear", "FP8Experts", "block_scales", "check", "experts_codes", "is_held",
           "restore", "swap", "weight_of"]

FP8Linear = hf_fp8.FP8Linear  # FP8GroupedLinear is one too
FP8Experts = hf_fp8.FP8Experts
_CONVERTED = ("csattn_gate_up_proj", "csattn_gate_up_scale", "csattn_down_proj", "csattn_down_scale")


def is_held(module: nn.Module) -> bool:
    """Whether ``module`` is one of HF's FP8-held modules (``FP8Linear``, ``FP8GroupedLinear``, ``FP8Experts``)."""
    return isinstance(module, (FP8Linear, FP8Experts))


def _is_fp4(module: nn.Module) -> bool:
    return isinstance(module, FP8Experts) and _codes(module, "down_proj").dtype != torch.float8_e4m3fn


def check(module: nn.Module, where: str) -> None:
    """Refuse an HF FP8 module that csattn's FP8 ops cannot run exactly (``ValueError`` naming ``where``)."""
    how = "load a bf16 copy instead (from_pretrained(..., quantization_config=FineGrainedFP8Config(dequantize=True)))"
    if module.activation_scheme != "dynamic":
        raise ValueError(f"{where}: activation_scheme={module.activation_scheme!r}; csattn's FP8 ops quantize "
                         f"activations dynamically (static scales have no meaning in training); {how}")
    if getattr(module, "has_bias", False):
        raise ValueError(f"{where}: an FP8 linear with a bias; DeepSeek-V4's have none and csattn adds none; {how}")
    if isinstance(module, FP8Experts):
        odd = [n for n in ("swiglu_alpha", "gate_softcap", "up_softcap") if getattr(module, n, None) is not None]
        if odd or not module.has_gate:
            raise ValueError(f"{where}: FP8 experts with {odd or 'no gate'}; csattn's experts compute DeepSeek-V4's "
                             f"clamped SwiGLU; {how}")
        if _is_fp4(module):
            return  # converted at swap(): the conversion refuses what it cannot hold
    if tuple(module.block_size or ()) != (BLOCK, BLOCK):
        raise ValueError(f"{where}: weight_block_size {module.block_size}; csattn's FP8 ops take one scale per "
                         f"{BLOCK} x {BLOCK} block (DeepSeek's release format): quantize with weight_block_size="
                         f"[{BLOCK}, {BLOCK}], or {how}")


def block_scales(scale: Tensor, shape: torch.Size, where: str, check: bool = False) -> Tensor:
    """HF's ``weight_scale_inv`` of a weight ``[..., N, K]`` (fp32 or ue8m0, ``[..., R, ceil(K / 128)]``) -> fp32
    ``[..., ceil(N / 128), ceil(K / 128)]`` (detached).

    ``R`` is ``ceil(N / 128)``, or 2 for a fused ``gate_up_proj`` with ``2I <= 128`` (HF keeps one scale row per
    half; csattn's one block then holds both halves, so their scales must be equal). ``check``: also refuse ue8m0
    NaN bytes and unequal halves (reads the values: a host sync; :func:`swap` checks once, forwards do not)."""
    s = decode_scale(scale.detach(), where, check)  # ue8m0: 2 ** (byte - 127), exact in fp32
    rows = -(-shape[-2] // BLOCK)
    if s.shape[-2] > rows:
        if check and bool((s[..., rows:, :] != s[..., :1, :]).any()):
            raise ValueError(f"{where}: the gate and up halves of this expert weight have their own FP8 scales "
                             f"within one {BLOCK}-row block; csattn's FP8 ops take one scale per {BLOCK} x {BLOCK} "
                             "block (moe_intermediate_size a multiple of 128, as in the release)")
        s = s[..., :rows, :]
    want = (*shape[:-2], rows, -(-shape[-1] // BLOCK))
    if tuple(s.shape) != want:
        raise ValueError(f"{where}: FP8 scales of shape {tuple(s.shape)} for a weight {tuple(shape)}; csattn's FP8 "
                         f"ops need {want} (one per {BLOCK} x {BLOCK} block)")
    return s.contiguous()


def _codes(module: nn.Module, name: str) -> Tensor:
    """The raw FP8 tensor ``name`` of ``module``, detached (also while PEFT parametrizes it: the original)."""
    parametrized = getattr(module, "parametrizations", None)
    if parametrized is not None and name in parametrized:
        return parametrized[name].original.detach()
    return module._parameters[name].detach()


def weight_of(module: nn.Module) -> Tensor:
    """``module``'s weight as the layer multiplies by it: an HF FP8 linear's dequantized in the model's compute dtype
    (a new tensor at every call, no gradient), any other module's ``weight``."""
    if not isinstance(module, FP8Linear):
        return module.weight
    codes = _codes(module, "weight")
    return dequantize(codes, block_scales(module.weight_scale_inv, codes.shape, module._csattn_where),
                      module.dtype_tag.dtype)


class PatchedFP8Linear(FP8Linear):
    """HF's ``FP8Linear`` on :func:`csattn.ops.fp8.fp8_linear` (differentiable in its input)."""

    frozen_storage = ("weight", "weight_scale_inv")  # never cast (csattn.amp), as csattn's own FP8-held modules

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        _apply_raw(self, fn, recurse)  # to(dtype) casts the compute dtype (dtype_tag), never the codes or scales
        return self

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., K]`` -> ``[..., N]``."""
        codes = _codes(self, "weight")
        scale = block_scales(self.weight_scale_inv, codes.shape, self._csattn_where)
        return fp8_linear(x, codes, scale, compute=self._csattn_compute)


class PatchedFP8GroupedLinear(hf_fp8.FP8GroupedLinear):
    """HF's ``FP8GroupedLinear`` (``o_a_proj``; the attention reads its weight) on its dequantized weight."""

    frozen_storage = PatchedFP8Linear.frozen_storage
    _apply = PatchedFP8Linear._apply

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., G, K]`` -> ``[..., G, N / G]``: group ``g`` of ``x`` times block ``g`` of the weight (HF's
        ``DeepseekV4GroupedLinear``)."""
        g, k = self.n_groups, x.shape[-1]
        y = torch.bmm(x.reshape(-1, g, k).transpose(0, 1), weight_of(self).view(g, -1, k).transpose(1, 2))
        return y.transpose(0, 1).reshape(*x.shape[:-2], g, -1)


class PatchedFP8Experts(FP8Experts):
    """HF's ``FP8Experts`` on :func:`csattn.ops.moe.moe_experts` with the FP8 scales (grouped FP8 GEMMs)."""

    # (+ the converted copies of MXFP4 experts, per instance: see swap)
    frozen_storage = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")
    _apply = PatchedFP8Linear._apply

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                gate_up_lora: ExpertLora | None = None, down_lora: ExpertLora | None = None) -> Tensor:
        """``hidden_states [N, D]``, ``top_k_index [N, k]``, ``top_k_weights [N, k]`` -> ``[N, D]``; LoRA per expert
        on the two weights (``gate_up_lora`` / ``down_lora``, see :class:`csattn.ops.moe.ExpertLora`)."""
        gate_up, gate_up_scale, down, down_scale = experts_codes(self)
        return moe_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, self.limit,
                           self._csattn_backend, gate_up_lora, down_lora, gate_up_scale=gate_up_scale,
                           down_scale=down_scale, fp8_compute=self._csattn_compute)


def experts_codes(module: nn.Module) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(gate_up [E, 2I, D], its scales, down [E, D, I], its scales)``: e4m3 codes and fp32 128 x 128 block scales
    of HF's FP8 experts (MXFP4 ones: the copies converted at :func:`swap`)."""
    if _is_fp4(module):
        return tuple(getattr(module, name) for name in _CONVERTED)
    where = module._csattn_where
    gate_up, down = _codes(module, "gate_up_proj"), _codes(module, "down_proj")
    return (gate_up, block_scales(module.gate_up_proj_scale_inv, gate_up.shape, f"{where}.gate_up_proj"),
            down, block_scales(module.down_proj_scale_inv, down.shape, f"{where}.down_proj"))


def _convert_fp4(module: nn.Module, where: str) -> None:
    """MXFP4 experts -> FP8 e4m3 copies with 128 x 128 block scales (non-persistent buffers), exactly."""
    out = []
    for name in ("gate_up_proj", "down_proj"):
        packed, group_scale = _codes(module, name), getattr(module, f"{name}_scale_inv").detach()
        # where the experts are, one expert at a time (the converter's intermediates are a few times its input)
        codes, scale, inexact = (torch.stack(t) for t in zip(*(
            mxfp4_to_fp8(packed[e], group_scale[e], f"{where}.{name}") for e in range(packed.shape[0]))))
        if bool(inexact.any()):
            e, r, c = (int(i) for i in inexact.nonzero()[0])
            raise ValueError(f"{where}.{name}: expert {e}'s {BLOCK} x {BLOCK} block ({r}, {c}) mixes MXFP4 group "
                             "scales too far apart for one FP8 block scale (its small values would round); load a "
                             "bf16 copy (FineGrainedFP8Config(dequantize=True)) or csattn's own loader "
                             "(load_pretrained(..., allow_inexact_fp8=True))")
        out += [codes, scale]
    for name, t in zip(_CONVERTED, out):
        module.register_buffer(name, t, persistent=False)
    module.frozen_storage = (*PatchedFP8Experts.frozen_storage, *_CONVERTED)


PATCHED = {FP8Linear: PatchedFP8Linear, hf_fp8.FP8GroupedLinear: PatchedFP8GroupedLinear}


def swap(module: nn.Module, where: str, dtype: torch.dtype, compute: str, backend: BackendChoice) -> None:
    """Make HF's FP8 ``module`` run csattn's FP8 ops, in place (its parameters untouched): ``dtype`` is the
    model's compute dtype (dequantized weights; the ``dtype_tag`` buffer), ``compute`` the FP8 ops' mode (one of
    :data:`COMPUTES`), ``backend`` the experts'. ``ValueError`` naming ``where`` for what they cannot run."""
    check(module, where)  # everything refused before anything changes
    experts = isinstance(module, FP8Experts)
    if experts and _is_fp4(module):
        _convert_fp4(module, where)
    else:
        for name in ("gate_up_proj", "down_proj") if experts else ("weight",):
            scale = getattr(module, f"{name}_scale_inv" if experts else "weight_scale_inv")
            block_scales(scale, _codes(module, name).shape, f"{where}.{name}", check=True)
    hf_class = type(module)
    if experts:
        module.__class__ = PatchedFP8Experts
        module._csattn_backend = backend
    else:
        module.__class__ = PATCHED[hf_fp8.FP8GroupedLinear if isinstance(module, hf_fp8.FP8GroupedLinear)
                                   else FP8Linear]
    module._csattn_hf_class = hf_class
    module._csattn_where, module._csattn_compute = where, compute
    # the compute dtype, as csattn's FP8-held modules carry it: an empty buffer that moves and casts with the model
    # (csattn.amp.low_precision_parameters reads it as the autocast dtype)
    device = _codes(module, "down_proj" if experts else "weight").device
    module.register_buffer("dtype_tag", torch.empty(0, dtype=dtype, device=device), persistent=False)


def restore(module: nn.Module) -> None:
    """Undo :func:`swap`: HF's class and forward, the converted MXFP4 copies dropped."""
    module.__class__ = module._csattn_hf_class
    for name in ("_csattn_hf_class", "_csattn_where", "_csattn_compute", "_csattn_backend", "frozen_storage"):
        module.__dict__.pop(name, None)
    for name in (*_CONVERTED, "dtype_tag"):
        module._buffers.pop(name, None)
