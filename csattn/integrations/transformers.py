"""Train a Hugging Face ``DeepseekV4ForCausalLM`` on csattn's kernels, with ``transformers.Trainer`` or TRL.

Example:
    >>> from transformers import DataCollatorWithFlattening, DeepseekV4ForCausalLM, Trainer
    >>> from csattn.integrations.transformers import patch
    >>> model = patch(DeepseekV4ForCausalLM.from_pretrained(path))       # in place, same parameters
    >>> Trainer(model=model, args=args, train_dataset=docs, data_collator=DataCollatorWithFlattening()).train()

:func:`patch` changes, in place and without copying a parameter:

- every ``self_attn`` becomes a :class:`csattn.HybridAttention` built around the HF module's own
  ``nn.Parameter`` objects (same names, so ``state_dict`` / ``save_pretrained`` are unchanged);
- the decoder layers run the mHC through :mod:`csattn.ops.mhc` (``hc_pre`` / ``hc_combine``), each site applying
  the RMSNorm after it (HF's math; the fused kernels recompute the collapse instead of keeping it); the routed
  experts run :func:`csattn.ops.moe.moe_experts`
  (HF's routers and shared experts stay);
- ``DeepseekV4Model.forward`` packs the batch into csattn's layout (:func:`batch_layout`): the real tokens of
  the batch, one ``PackedSeqs`` document each, run through the decoder as ``[T, ...]`` rows and are written
  back to ``[B, S, D]`` (zeros at padding), so HF's LM head and loss (``num_items_in_batch``) work unchanged.
  No ``[S, S]`` mask is built.

Batches it accepts (documents never see each other; positions restart at 0 in every document):

- padding-free ``input_ids [1, T]`` with ``position_ids`` restarting at 0 per document (HF's
  ``DataCollatorWithFlattening``, TRL's ``padding_free``), optionally with ``cu_seq_lens_q`` / ``cu_seq_lens_k``
  / ``max_length_q`` / ``max_length_k`` (``return_flash_attn_kwargs=True``), or with those kwargs alone;
- ``[B, S]`` with a 2-D ``attention_mask``: each row is one document, made of its 1s (left or right padding).
  Padding tokens change no real token and get zero hidden states. (HF's own eager model numbers a
  left-padded row from the first pad and pools pads into its compressed entries; here a row starts at 0.)

Mixed precision: under ``torch.autocast`` (``Trainer(bf16=True)``, TRL's default) the attention layers and
routed experts run in the autocast dtype and the mHC in fp32 (:mod:`csattn.amp`); the residual streams stay fp32,
as in HF. ``output_router_logits=True`` (TRL sets it when ``router_aux_loss_coef`` is not 0) returns the routers'
logits as HF does, so HF's (or TRL's) load-balancing loss is added to the loss.

Limits: training forwards only. ``past_key_values`` or ``use_cache=True`` (``generate()``) raise a
``ValueError``; call :func:`unpatch` first (it puts HF's modules back, the same parameters). No
``output_attentions`` / ``output_hidden_states``. ``position_ids`` must count
0, 1, 2, ... inside each document. The lightning indexer gets no LM gradient (as in HF); with
``indexer_loss_coeff > 0`` it trains on csattn's indexer KL loss (under gradient accumulation also pass
``patch(..., indexer_loss_scale=1 / gradient_accumulation_steps)``).

PEFT: ``patch`` takes a ``PeftModel`` too, and adapters put on after ``patch`` work as well; each one either trains
as in HF + PEFT or is refused (:mod:`csattn.integrations.peft`). A model loaded in FP8 (``FineGrainedFP8Config``:
``FP8Linear``, ``FP8GroupedLinear``, FP8 or MXFP4 ``FP8Experts``) runs on csattn's FP8 ops with its weights frozen
(:mod:`csattn.integrations.hf_fp8`); what they cannot run exactly is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from ..config import AttentionConfig
from ..layers import HybridAttention
from ..layers.modules import Projection
from ..ops import mhc as mhc_ops
from ..ops.backend import BACKENDS, BackendChoice, check_backend
from ..ops.moe import ExpertLora, moe_experts
from ..ops.rope import rope_inv_freq
from ..packing import PackedSeqs
from . import hf_fp8
from . import peft as peft_bridge

__all__ = ["BACKENDS", "BatchLayout", "batch_layout", "is_patched", "patch", "unpatch"]

_UNPATCH = "call csattn.integrations.transformers.unpatch(model) first (same parameters, HF's own modules)"


# ---------------------------------------------------------------------------------------------- batch layout
@dataclass
class BatchLayout:
    """Where the real tokens of an HF batch ``[B, S]`` sit in csattn's packed stream ``[T]``.

    Attributes:
        packed: the stream's documents, without padding rows (``T`` = number of real tokens).
        index: ``[T]`` int64 positions in the flattened ``B * S`` batch of the stream's rows (row-major order);
            None when every token is real (the stream is the batch flattened).
        batch_shape: ``(B, S)``.
    """

    packed: PackedSeqs
    index: Tensor | None
    batch_shape: tuple[int, int]

    def gather(self, x: Tensor) -> Tensor:
        """``[B, S, ...]`` -> the stream's rows ``[T, ...]``."""
        flat = x.reshape(self.batch_shape[0] * self.batch_shape[1], *x.shape[2:])
        return flat if self.index is None else flat.index_select(0, self.index)

    def scatter(self, y: Tensor) -> Tensor:
        """The stream's rows ``[T, ...]`` -> ``[B, S, ...]``, zeros at padding (differentiable)."""
        b, s = self.batch_shape
        if self.index is not None:
            y = y.new_zeros(b * s, *y.shape[1:]).index_copy(0, self.index, y)
        return y.reshape(b, s, *y.shape[1:])


def batch_layout(
    batch_shape: tuple[int, int],
    device: torch.device | str,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    cu_seq_lens_q: Tensor | None = None,
    cu_seq_lens_k: Tensor | None = None,
    max_length_q: int | None = None,
) -> BatchLayout:
    """The documents of an HF batch, as csattn's packed layout.

    Args:
        batch_shape: ``(B, S)`` of ``input_ids``.
        device: where the metadata goes (the activations' device).
        attention_mask: ``[B, S]`` 1 = real token; each row's 1s must be one run (left or right padding).
        position_ids: ``[B, S]`` (or ``[1, S]`` / ``[S]`` for every row); a 0 starts a new document, and inside
            a document they must count 0, 1, 2, ... (csattn derives positions from the layout).
        cu_seq_lens_q: ``[N + 1]`` document boundaries of a flattened batch (``B = 1``, no padding).
        cu_seq_lens_k: must equal ``cu_seq_lens_q`` when given (causal self-attention).
        max_length_q: when given, at least the longest document.

    Returns:
        :class:`BatchLayout`. Reads the metadata on the host (one sync per forward).
    """
    b, s = batch_shape
    real = _padding(attention_mask, b, s, device)
    pos = _positions(position_ids, b, s, device)
    index = None
    if cu_seq_lens_q is not None:
        lengths = _flattened_lengths(cu_seq_lens_q, cu_seq_lens_k, b, s, real)
        flat_pos = None if pos is None else pos.reshape(-1)
    else:
        lengths, index, flat_pos = _row_lengths(real, pos, b, s, device)
    if flat_pos is not None and flat_pos.numel():
        _check_positions(flat_pos, lengths, index, s, device)
    if max_length_q is not None and lengths.numel() and int(max_length_q) < int(lengths.max()):
        raise ValueError(f"max_length_q = {max_length_q} is below the longest document ({int(lengths.max())})")
    packed = PackedSeqs.from_lengths([int(n) for n in lengths], device=device)
    return BatchLayout(packed=packed, index=index, batch_shape=(b, s))


def _padding(attention_mask: Tensor | None, b: int, s: int, device: torch.device | str) -> Tensor | None:
    """``[B, S]`` bool of the real tokens, or ``None`` where every token is real."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != (b, s):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be the 2-D padding mask [B, S] = [{b}, {s}] (1 = real token), "
                         f"got {got}")
    real = attention_mask.to(device) != 0
    return None if bool(real.all()) else real


def _positions(position_ids: Tensor | None, b: int, s: int, device: torch.device | str) -> Tensor | None:
    """``position_ids`` as ``[B, S]`` int64 (one row given: every row's)."""
    if position_ids is None:
        return None
    pos = position_ids.to(device=device, dtype=torch.long)
    pos = pos.reshape(1, -1) if pos.dim() == 1 else pos
    if pos.dim() == 2 and pos.shape[0] == 1 and pos.shape[1] == s:
        pos = pos.expand(b, s)
    if tuple(pos.shape) != (b, s):
        raise ValueError(f"position_ids must have shape [B, S] = [{b}, {s}] (or [1, S]), "
                         f"got {tuple(position_ids.shape)}")
    return pos


def _flattened_lengths(cu_seq_lens_q: Tensor, cu_seq_lens_k: Tensor | None, b: int, s: int,
                       real: Tensor | None) -> Tensor:
    """The documents' lengths (host, int64, empty ones dropped) of a flattened batch ``[1, T]``."""
    cu = torch.as_tensor(cu_seq_lens_q).reshape(-1).to("cpu", torch.long)
    if cu_seq_lens_k is not None and not torch.equal(torch.as_tensor(cu_seq_lens_k).reshape(-1).to("cpu", torch.long),
                                                     cu):
        raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q (causal self-attention over the same documents)")
    if b != 1:
        raise ValueError(f"cu_seq_lens_q describes a flattened batch input_ids [1, T]; got [B, S] = [{b}, {s}]")
    if real is not None:
        raise ValueError("cu_seq_lens_q and an attention_mask with padding do not go together: flattened "
                         "batches have no padding (drop the attention_mask)")
    lengths = cu[1:] - cu[:-1]
    if cu.numel() < 2 or int(cu[0]) != 0 or bool((lengths < 0).any()) or int(cu[-1]) != s:
        raise ValueError(f"cu_seq_lens_q must rise from 0 to the flattened length {s}, got {cu.tolist()[:16]}")
    return lengths[lengths > 0]


def _row_lengths(real: Tensor | None, pos: Tensor | None, b: int, s: int,
                 device: torch.device | str) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """A padded batch's documents: each row's real tokens one run, cut further where ``pos`` restarts at 0.
    Returns the lengths (host), the real tokens' flat index into ``[B * S]`` (``None`` without padding) and their
    positions (or ``None``)."""
    index = None
    if real is not None:
        count = real.sum(1)
        first = real.int().argmax(1)
        last = s - 1 - real.flip(1).int().argmax(1)
        gaps = (count > 0) & (last - first + 1 != count)
        if bool(gaps.any()):
            row = int(gaps.nonzero()[0, 0])
            raise ValueError(f"attention_mask row {row} has padding between real tokens; each row must be one "
                             "document (left or right padding); pack several documents with position_ids instead")
        index = real.reshape(-1).nonzero().squeeze(1)
        rows = index // s
    else:
        rows = torch.arange(b * s, device=device) // s
    total = rows.shape[0]
    start = torch.ones(total, dtype=torch.bool, device=device)
    start[1:] = rows[1:] != rows[:-1]
    flat_pos = None
    if pos is not None:
        flat_pos = pos.reshape(-1) if index is None else pos.reshape(-1)[index]
        start |= flat_pos == 0
    starts = start.nonzero().squeeze(1)
    lengths = (torch.cat([starts, starts.new_tensor([total])]) - torch.cat([starts.new_zeros(1), starts]))[1:]
    return lengths.cpu(), index, flat_pos


def _check_positions(flat_pos: Tensor, lengths: Tensor, index: Tensor | None, s: int,
                     device: torch.device | str) -> None:
    """``position_ids`` must count 0, 1, 2, ... inside each document: csattn derives positions from the layout."""
    doc_start = (lengths.cumsum(0) - lengths).to(device)
    offsets = torch.arange(flat_pos.numel(), device=device) - doc_start.repeat_interleave(lengths.to(device))
    bad = flat_pos != offsets
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        where = int(index[i]) if index is not None else i
        raise ValueError(
            f"position_ids must count 0, 1, 2, ... inside each document (a 0 starts the next one); at row "
            f"{where // s}, column {where % s} it is {int(flat_pos[i])} where the document layout gives "
            f"{int(offsets[i])}. csattn derives the positions from the documents: pass position_ids that restart "
            "at 0 per document (DataCollatorWithFlattening does), or none")


# ---------------------------------------------------------------------------------------------- patched modules
class _PatchedAttention(HybridAttention):
    """``HybridAttention`` whose parameters are an HF ``DeepseekV4Attention``'s own ``nn.Parameter`` objects."""

    def _apply(self, fn: Any, recurse: bool = True) -> _PatchedAttention:
        super()._apply(fn, recurse)
        # ``model.to(torch.bfloat16)`` would round the RoPE frequencies; rebuild them in fp32 on the new device
        self._reset_rope(self.inv_freq.device)
        return self

    def _reset_rope(self, device: torch.device) -> None:
        cfg = self.config
        self.inv_freq = rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)

    def projection(self, name: str) -> Projection:
        """The projection's weight plus the LoRA adapters PEFT put on it (:func:`csattn.integrations.peft
        .effective_weight`; an FP8-held one dequantized): the fused paths read these weights instead of calling the
        modules."""
        return Projection(peft_bridge.effective_weight(self.get_submodule(name), f"self_attn.{name}"))

    def compute_dtype(self) -> torch.dtype:
        """The model's compute dtype also where ``q_a_proj`` is held in FP8."""
        q_a = peft_bridge.innermost(self.q_a_proj)
        return q_a.dtype_tag.dtype if hf_fp8.is_held(q_a) else super().compute_dtype()


class _PatchedDecoderLayer(hf.DeepseekV4DecoderLayer):
    """HF's decoder layer on packed streams ``[T, n, D]``: mHC and RMSNorm through csattn's ops, attention =
    :class:`_PatchedAttention` with ``packed=``, HF's MoE block (its experts patched) on ``[1, T, D]``."""

    _csattn_backend = "auto"
    _csattn_where = "model.layers.?"
    _csattn_indexer_loss_scale = 1.0

    def forward(self, hidden_states: Tensor, input_ids: Tensor | None = None, packed: PackedSeqs | None = None,
                **kwargs: Any) -> Tensor:
        """``hidden_states [T, n, D]`` streams, ``input_ids [T]``, ``packed`` the stream's documents
        -> ``[T, n, D]``."""
        if packed is None:
            raise TypeError("this DeepseekV4DecoderLayer was patched by csattn and runs inside the patched "
                            f"DeepseekV4Model only (it needs packed=); to run HF's code, {_UNPATCH}")
        backend = self._csattn_backend
        post, comb, x = _hc_pre(self.attn_hc, hidden_states, backend, self.input_layernorm)
        y = self.self_attn(x, packed=packed, indexer_loss_scale=self._csattn_indexer_loss_scale)
        streams = mhc_ops.hc_combine(hidden_states, y, post, comb, backend=backend)
        post, comb, x = _hc_pre(self.ffn_hc, streams, backend, self.post_attention_layernorm)
        y = _moe(self.mlp, x, input_ids, f"{self._csattn_where}.mlp.experts")
        return mhc_ops.hc_combine(streams, y, post, comb, backend=backend)


def _moe(block: hf.DeepseekV4SparseMoeBlock, x: Tensor, input_ids: Tensor | None, where: str) -> Tensor:
    """HF's ``DeepseekV4SparseMoeBlock.forward`` on rows ``x [T, D]`` (``input_ids [T]`` for hash routing) ->
    ``[T, D]``: its router and shared experts called as modules, the routed experts with PEFT's LoRA on their tensors
    passed to csattn's op as pairs per expert (:func:`csattn.integrations.peft.expert_loras`; ``where`` names the
    experts in its errors)."""
    h = x.unsqueeze(0)
    _, weights, indices = block.gate(h, input_ids.unsqueeze(0)) if block.is_hash else block.gate(h)
    inner = peft_bridge.innermost(block.experts)
    if isinstance(inner, (_PatchedExperts, hf_fp8.PatchedFP8Experts)):
        shapes = {"gate_up_proj": (2 * inner.intermediate_dim, inner.hidden_dim),
                  "down_proj": (inner.hidden_dim, inner.intermediate_dim)}
        loras = peft_bridge.expert_loras(block.experts, shapes, where)
        loras = {k: ExpertLora(lo.a.to(x.dtype), lo.b.to(x.dtype), lo.scale) for k, lo in loras.items()}
        routed = inner(x, indices, weights, loras.get("gate_up_proj"), loras.get("down_proj"))
    else:
        routed = block.experts(x, indices, weights)
    return routed + block.shared_experts(x)


class _PatchedExperts(hf.DeepseekV4Experts):
    """HF's routed experts through :func:`csattn.ops.moe.moe_experts` (grouped GEMMs; Triton SwiGLU on CUDA)."""

    _csattn_backend = "auto"

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                gate_up_lora: ExpertLora | None = None, down_lora: ExpertLora | None = None) -> Tensor:
        """``hidden_states [N, D]``, ``top_k_index [N, k]``, ``top_k_weights [N, k]`` -> ``[N, D]``; LoRA per expert
        on the two weights (:class:`csattn.ops.moe.ExpertLora`)."""
        return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                           self.limit, self._csattn_backend, gate_up_lora, down_lora)


class _PatchedModel(hf.DeepseekV4Model):
    """HF's ``DeepseekV4Model`` running the decoder on csattn's packed layout (see the module docstring)."""

    _csattn_backend = "auto"

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> MoeModelOutputWithPast:
        """``input_ids [B, S]`` (or ``inputs_embeds [B, S, D]``) -> ``last_hidden_state [B, S, D]``.

        ``attention_mask [B, S]``, ``position_ids`` and ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q``
        (kwargs) describe the documents (:func:`batch_layout`); ``output_router_logits`` (default: the config's)
        also returns every learned router's logits as HF does, ``[B * S, E]`` per layer (zeros at padding, which
        HF's load-balancing loss masks out), for HF's or TRL's auxiliary loss; other kwargs
        (``num_items_in_batch``, ...) are the loss's and are ignored here.
        """
        _refuse_unsupported(past_key_values, use_cache, kwargs)
        peft_bridge.check_adapters(self)  # PEFT may have added adapters since patch()
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if embeds.dim() != 3:
            raise ValueError(f"input_ids must be [B, S] (inputs_embeds [B, S, D]), got {tuple(embeds.shape[:-1])}")
        if input_ids is None and any(layer.mlp.is_hash for layer in self.layers):
            raise ValueError("input_ids is required: this model's first MoE layers route by token id (hash_moe)")
        b, s, _ = embeds.shape
        layout = batch_layout((b, s), embeds.device, attention_mask, position_ids, kwargs.get("cu_seq_lens_q"),
                              kwargs.get("cu_seq_lens_k"), kwargs.get("max_length_q"))
        streams = layout.gather(embeds)
        streams = streams.unsqueeze(-2).expand(-1, self.config.hc_mult, -1).contiguous()  # [T, n, D]
        ids = None if input_ids is None else layout.gather(input_ids)
        want_router = kwargs.get("output_router_logits")
        if want_router is None:
            want_router = bool(getattr(self.config, "output_router_logits", False))
        router_logits: list[Tensor] = []
        # HF records the learned routers' logits (output 0) by hooks; hash routers' choice is a table lookup
        hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: router_logits.append(out[0]))
                 for layer in self.layers if want_router and isinstance(layer.mlp.gate, hf.DeepseekV4TopKRouter)]
        try:
            for layer in self.layers:
                # streams positional: HF's gradient checkpointing (reentrant) needs the grad-carrying input there
                streams = layer(streams, input_ids=ids, packed=layout.packed)
        finally:  # a recomputation in the backward (gradient checkpointing) records nothing
            for hook in hooks:
                hook.remove()
        head = self.hc_head
        # the final norm inside the head site (row-wise, so before the scatter to [B, S] as well as after)
        final = mhc_ops.hc_head(streams, head.hc_fn, head.hc_base, head.hc_scale, hc_eps=head.eps,
                                norm_eps=head.input_norm.eps, norm_weight=self.norm.weight,
                                rms_eps=self.norm.variance_epsilon, backend=self._csattn_backend)
        logits = tuple(layout.scatter(x).reshape(b * s, -1) for x in router_logits) if want_router else None
        return MoeModelOutputWithPast(last_hidden_state=layout.scatter(final), router_logits=logits)


def _hc_pre(site: hf.DeepseekV4HyperConnection, streams: Tensor, backend: BackendChoice,
            norm: hf.DeepseekV4RMSNorm) -> tuple[Tensor, Tensor, Tensor]:
    # HF's RMSNorm math (fp32, weight applied before the cast back) applied by the site, which keeps one scale per
    # row instead of the collapsed input
    return mhc_ops.hc_pre(streams, site.fn, site.base, site.scale, sinkhorn_iters=site.hc_sinkhorn_iters,
                          hc_eps=site.hc_eps, norm_eps=site.input_norm.eps, norm_weight=norm.weight,
                          rms_eps=norm.variance_epsilon, backend=backend)


def _refuse_unsupported(past_key_values: Any, use_cache: bool | None, kwargs: dict[str, Any]) -> None:
    # use_cache=None means "the config's default" in HF (True for V4): a training forward never builds a cache,
    # so only an explicit True (generate() passes one) is refused
    if past_key_values is not None:
        raise ValueError("past_key_values: a model patched by csattn.integrations.transformers runs training "
                         f"forwards only (no KV cache); for generate() or cached decoding {_UNPATCH}")
    if use_cache:
        raise ValueError("use_cache=True: a model patched by csattn.integrations.transformers builds no KV cache; "
                         f"pass use_cache=False, or for generate() {_UNPATCH}")
    for key in ("output_attentions", "output_hidden_states"):
        if kwargs.get(key):
            raise ValueError(f"{key}=True is not supported by the csattn-patched DeepseekV4 model (it runs packed "
                             f"rows, not [B, S] tensors per layer); set it to False (config.{key}), or {_UNPATCH}")


# ---------------------------------------------------------------------------------------------- patch / unpatch
@dataclass
class _PatchState:
    backend: BackendChoice
    indexer_loss_coeff: float
    hf_attention: list[nn.Module]  # HF's attention modules, put back by unpatch
    experts_patched: bool
    num_experts_added: bool = False  # config.num_experts set by patch (see there), removed by unpatch
    deterministic: bool = False  # the layers' AttentionConfig.deterministic
    held: list[nn.Module] = field(default_factory=list)  # HF's FP8 modules running csattn's FP8 ops


def _backbone(model: nn.Module) -> hf.DeepseekV4Model:
    model = peft_bridge.unwrap_model(model)  # a PeftModel: the transformers model inside
    if isinstance(model, hf.DeepseekV4ForCausalLM):
        return model.model
    if isinstance(model, hf.DeepseekV4Model):
        return model
    raise TypeError("model must be a transformers DeepseekV4ForCausalLM or DeepseekV4Model (or a PeftModel of "
                    f"one), got {type(model).__name__}")


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`patch` was applied to ``model`` (a ``DeepseekV4ForCausalLM`` or ``DeepseekV4Model``)."""
    return isinstance(_backbone(model), _PatchedModel)


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def _csattn_attention(hf_attn: nn.Module, config: Any, layer_idx: int, backend: BackendChoice,
                      indexer_loss_coeff: float, deterministic: bool = False) -> _PatchedAttention:
    cfg = AttentionConfig.from_hf(config, layer_idx, backend=backend, indexer_loss_coeff=indexer_loss_coeff,
                                  compute_indexer_loss=indexer_loss_coeff > 0, deterministic=deterministic)
    with torch.device("meta"):  # no memory for weights that are replaced right away
        attn = _PatchedAttention(cfg)
    # HF's FP8-held linears go in whole (their codes and scales; csattn calls or reads them through hf_fp8)
    held = [path for path, m in hf_attn.named_modules() if hf_fp8.is_held(m)]
    for path in held:
        module = hf_attn.get_submodule(path)
        mine = dict(attn.named_modules()).get(path)
        if mine is None or tuple(mine.weight.shape) != tuple(module.weight.shape):
            raise ValueError(f"model.layers[{layer_idx}].self_attn.{path}: an FP8 {tuple(module.weight.shape)} "
                             "where csattn's attention has "
                             f"{'no module' if mine is None else tuple(mine.weight.shape)}")
        attn.set_submodule(path, module)

    def plain(named: Any) -> dict[str, nn.Parameter]:
        return {n: p for n, p in named if not any(n.startswith(f"{path}.") for path in held)}

    theirs, ours = plain(hf_attn.named_parameters()), plain(attn.named_parameters())
    if set(theirs) != set(ours):
        raise ValueError(f"model.layers[{layer_idx}].self_attn: parameters csattn lacks "
                         f"{sorted(set(theirs) - set(ours))}, parameters HF lacks {sorted(set(ours) - set(theirs))}")
    for name, param in theirs.items():
        if tuple(param.shape) != tuple(ours[name].shape):
            raise ValueError(f"model.layers[{layer_idx}].self_attn.{name}: shape {tuple(param.shape)}, the config "
                             f"gives {tuple(ours[name].shape)}")
        owner, leaf = _owner(attn, name)
        setattr(owner, leaf, param)  # the same nn.Parameter object: no copy, optimizers and hooks see one tensor
    attn._reset_rope(hf_attn.sinks.device)
    attn.train(hf_attn.training)
    return attn


def patch(model: nn.Module, *, backend: BackendChoice = "auto", indexer_loss_coeff: float = 0.0,
          indexer_loss_scale: float = 1.0, deterministic: bool = False, fp8_compute: str = "fp8") -> nn.Module:
    """Make an HF ``DeepseekV4ForCausalLM`` (or ``DeepseekV4Model``) run csattn's kernels, in place.

    Args:
        model: from ``from_pretrained`` or the constructor, or a ``PeftModel`` of one; its parameters are reused,
            never copied. PEFT adapters, put on before or after ``patch``, train as in HF or are refused
            (:mod:`csattn.integrations.peft`).
        backend: ``"auto"`` (Triton kernels on CUDA, the PyTorch reference and grouped MoE GEMMs elsewhere),
            ``"reference"`` (plain PyTorch everywhere, the per-expert MoE loop) or ``"triton"``.
        indexer_loss_coeff: weight of csattn's indexer KL loss on CSA layers (its gradient trains the lightning
            indexer, which the LM loss never reaches); 0 = none, as in HF.
        indexer_loss_scale: the gradient each backward sends into the indexer loss: the scale the trainer puts on
            the LM loss, ``1 / gradient_accumulation_steps`` under gradient accumulation (default 1).
        deterministic: the attention kernels' scatter-add gradients in exact fixed point (bitwise reproducible;
            ``AttentionConfig.deterministic``); run the steps inside ``csattn.deterministic_mode()`` too for
            the torch ops.
        fp8_compute: for a model loaded in FP8 (HF's ``FineGrainedFP8Config``): ``"fp8"`` (activations quantized
            per 1x128 tile, FP8 tensor cores) or ``"w8a16"`` (the weight dequantized in the kernel, bf16 numerics)
            on the GPU; the CPU dequantizes exactly either way (:mod:`csattn.integrations.hf_fp8`).

    Returns:
        ``model`` itself, patched (see the module docstring for the batches it takes and its limits).
    """
    backbone = _backbone(model)
    if isinstance(backbone, _PatchedModel):
        raise ValueError(f"model is already patched by csattn; {_UNPATCH.replace('first', 'to patch it again')}")
    _check_patch_args(backend, indexer_loss_coeff, indexer_loss_scale, fp8_compute)
    _check_patchable(backbone)
    config = backbone.config
    held = _swap_held(backbone, backend, fp8_compute)  # HF's FP8 modules onto csattn's FP8 ops (MXFP4 converted)
    attentions, adapters = _build_attentions(backbone, held, backend, indexer_loss_coeff, bool(deterministic))
    experts = config.hidden_act == "silu"  # csattn's experts compute a clamped SwiGLU (silu); others stay HF's
    state = _PatchState(backend, indexer_loss_coeff, [layer.self_attn for layer in backbone.layers], experts,
                        deterministic=bool(deterministic), held=held)
    for i, (layer, attn, found) in enumerate(zip(backbone.layers, attentions, adapters)):
        peft_bridge.reattach(attn, found)
        layer.self_attn = attn
        layer.__class__ = _PatchedDecoderLayer
        layer._csattn_backend, layer._csattn_where = backend, f"model.layers.{i}"
        layer._csattn_indexer_loss_scale = float(indexer_loss_scale)
        moe = peft_bridge.innermost(layer.mlp.experts)  # LoRA on the experts' tensors wraps them
        if experts and not hf_fp8.is_held(moe):
            moe.__class__ = _PatchedExperts
            moe._csattn_backend = backend
    # TRL's load-balancing loss (SFTTrainer's default when router_aux_loss_coef != 0) reads config.num_experts,
    # a name DeepseekV4Config does not define (num_local_experts / n_routed_experts): give it the alias
    if not hasattr(config, "num_experts"):
        config.num_experts = config.num_local_experts
        state.num_experts_added = True
    backbone.__class__ = _PatchedModel
    backbone._csattn_backend = backend
    backbone._csattn_state = state
    return model


def _check_patch_args(backend: BackendChoice, indexer_loss_coeff: float, indexer_loss_scale: float,
                      fp8_compute: str) -> None:
    check_backend(backend)
    if not indexer_loss_coeff >= 0:
        raise ValueError(f"indexer_loss_coeff must be >= 0, got {indexer_loss_coeff}")
    if not 0 < indexer_loss_scale < float("inf"):
        raise ValueError(f"indexer_loss_scale must be a finite number > 0 (e.g. 1 / gradient_accumulation_steps), "
                         f"got {indexer_loss_scale}")
    if fp8_compute not in hf_fp8.COMPUTES:
        raise ValueError(f"fp8_compute must be one of {hf_fp8.COMPUTES}, got {fp8_compute!r}")


def _build_attentions(backbone: hf.DeepseekV4Model, held: list[nn.Module], backend: BackendChoice,
                      indexer_loss_coeff: float, deterministic: bool) -> tuple[list[nn.Module], list]:
    """csattn's attention for every layer, built before anything else changes, so that a failure leaves the model
    as it was (its FP8 modules restored, PEFT's wrappers back on HF's attention). Returns the attentions and the
    PEFT wrappers taken off HF's attention modules, to go around csattn's (the same parameters)."""
    adapters = [peft_bridge.detach(layer.self_attn) for layer in backbone.layers]
    try:
        attentions = [_csattn_attention(layer.self_attn, backbone.config, i, backend, indexer_loss_coeff,
                                        deterministic) for i, layer in enumerate(backbone.layers)]
    except Exception:
        for layer, found in zip(backbone.layers, adapters):
            peft_bridge.reattach(layer.self_attn, found)
        for module in held:
            hf_fp8.restore(module)
        raise
    return attentions, adapters


def _check_patchable(backbone: hf.DeepseekV4Model) -> None:
    """What patch() cannot run, refused before anything changes."""
    rotary = backbone.rotary_emb
    for kind in rotary.layer_types:
        scaling = float(getattr(rotary, f"{kind}_attention_scaling"))
        if scaling != 1.0:
            raise ValueError(f"config.rope_parameters[{kind!r}] scales cos/sin by {scaling} (YaRN attention_factor); "
                             "csattn applies no such factor (the V4 reference does not): set attention_factor=1.0")
    held = {id(p) for m in backbone.modules() if hf_fp8.is_held(m) for p in m.parameters()}
    for name, param in backbone.named_parameters():
        if param.element_size() == 1 and id(param) not in held:
            raise ValueError(f"model.{name} is {param.dtype} outside HF's FP8 modules (FP8Linear / FP8Experts): "
                             "patch() runs FP8 weights only as transformers' FineGrainedFP8Config holds them; load "
                             "a bf16 copy (FineGrainedFP8Config(dequantize=True))")
    for i, layer in enumerate(backbone.layers):
        moe = peft_bridge.innermost(layer.mlp.experts)
        if type(layer) is not hf.DeepseekV4DecoderLayer or not (type(moe) is hf.DeepseekV4Experts
                                                                or hf_fp8.is_held(moe)):
            raise TypeError(f"model.layers[{i}] is a {type(layer).__name__} (experts: "
                            f"{type(moe).__name__}); patch() takes HF's own DeepseekV4 modules")
        if hf_fp8.is_held(moe) and backbone.config.hidden_act != "silu":
            raise ValueError(f"model.layers[{i}].mlp.experts: FP8 experts with hidden_act="
                             f"{backbone.config.hidden_act!r}; csattn's FP8 experts compute a clamped SwiGLU (silu)")
    peft_bridge.check_adapters(backbone)


def _swap_held(backbone: hf.DeepseekV4Model, backend: BackendChoice, compute: str) -> list[nn.Module]:
    """HF's FP8 modules of the decoder onto csattn's FP8 ops (:func:`csattn.integrations.hf_fp8.swap`, which refuses
    what they cannot run), dequantized weights in the embedding's dtype (the model's compute dtype); on a refusal the
    modules swapped so far are restored, so the model is as it was."""
    dtype = backbone.embed_tokens.weight.dtype
    held = [(f"model.{name}", m) for name, m in backbone.named_modules() if hf_fp8.is_held(m)]
    done = []
    try:
        for name, module in held:
            hf_fp8.swap(module, name, dtype, compute, backend)
            done.append(module)
    except Exception:
        for module in done:
            hf_fp8.restore(module)
        raise
    return done


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch` in place: HF's own modules and forwards, the same parameter objects (PEFT's wrappers
    around them). Returns ``model``."""
    backbone = _backbone(model)
    if not isinstance(backbone, _PatchedModel):
        raise ValueError("model is not patched by csattn (nothing to undo)")
    state: _PatchState = backbone._csattn_state
    for layer, hf_attn in zip(backbone.layers, state.hf_attention):
        found = peft_bridge.detach(layer.self_attn)
        # rebind whatever parameters the csattn module holds now (a user or a wrapper may have replaced some)
        for name, param in layer.self_attn.named_parameters():
            owner, leaf = _owner(hf_attn, name)
            setattr(owner, leaf, param)
        device = next(iter(layer.self_attn.parameters())).device
        hf_attn.to(device)  # its RoPE buffers stayed where they were when patched
        hf_attn.train(layer.self_attn.training)
        peft_bridge.reattach(hf_attn, found)
        layer.self_attn = hf_attn
        layer.__class__ = hf.DeepseekV4DecoderLayer
        del layer._csattn_backend, layer._csattn_where, layer._csattn_indexer_loss_scale
        moe = peft_bridge.innermost(layer.mlp.experts)
        if state.experts_patched and not hf_fp8.is_held(moe):
            moe.__class__ = hf.DeepseekV4Experts
            del moe._csattn_backend
    for module in state.held:
        hf_fp8.restore(module)
    backbone.__class__ = hf.DeepseekV4Model
    if state.num_experts_added:
        del backbone.config.num_experts
    del backbone._csattn_backend, backbone._csattn_state
    return model
