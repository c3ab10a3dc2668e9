"""The DeepSeek-V4 decoder for training on packed sequences (``[T]`` token ids, one ``PackedSeqs`` per
step, optional context parallelism). State-dict names equal Hugging Face's ``DeepseekV4ForCausalLM``
(``model.embed_tokens``, ``model.layers.{i}.{self_attn,mlp,attn_hc,ffn_hc,...}``, ``model.norm``,
``model.hc_head``, ``lm_head``); the MTP blocks, which HF does not build, live under ``mtp.{j}``.

Data flow of one step::

    ids [T] -> embed -> streams [T, n, D]
      per layer: attn_hc -> input_layernorm -> HybridAttention(packed, cp) -> combine
                 ffn_hc  -> post_attention_layernorm -> MoE -> combine
    -> hc_head -> norm -> lm_head -> logits [T, V] -> CE over rows with a label
    MTP block j: e_proj(enorm(embed(token t+j+1))) + h_proj(hnorm(streams)) -> one block -> its own
                 hc_head and norm -> the shared lm_head -> CE against token t+j+2
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ...layers import HybridAttention
from ...layers.modules import RMSNorm
from ...layers.plan import ContextParallelGroup
from ...ops.mhc import Site
from ...ops.recompute import rebuilt_saves
from ...packing import PackedSeqs
from .config import DeepseekV4ModelConfig
from .mhc import HyperConnection, HyperHead, expand_streams
from .moe import MoE

__all__ = ["DeepseekV4ForCausalLM", "DecoderLayer", "MTPBlock", "CausalLMOutput", "IGNORE_INDEX",
           "future_tokens", "FP32_MODULES", "TopParts", "draw_unit"]

IGNORE_INDEX = -100
# Kept in fp32 whatever the training dtype (HF's ``_keep_in_fp32_modules_strict``); any norm weight too.
FP32_MODULES = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias")


def future_tokens(input_ids: Tensor, packed: PackedSeqs, depth: int) -> Tensor:
    """Token ``t + j`` of the same document for ``j = 1..depth`` (``IGNORE_INDEX`` past its last real token).

    Row 0 is the next-token label, row ``j`` is MTP block ``j-1``'s label. Compute it on the whole (global)
    stream, then shard it with the rows under context parallelism.

    Args:
        input_ids: ``[T]`` int64. packed: the stream's layout.
    Returns:
        ``[depth, T]`` int64.
    """
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be [T], got shape {tuple(input_ids.shape)}")
    rows = packed.rows(input_ids.device)
    t = input_ids.shape[0]
    out = torch.full((depth, t), IGNORE_INDEX, dtype=torch.long, device=input_ids.device)
    limit = rows.real_len[rows.doc]  # tokens t + j with pos + j < real_len exist
    for j in range(1, depth + 1):
        ok = rows.real & (rows.pos + j < limit)
        src = torch.arange(t, device=input_ids.device) + j
        out[j - 1] = torch.where(ok, input_ids[src.clamp(max=t - 1)], out[j - 1])
    return out


@dataclass
class CausalLMOutput:
    """``loss`` = ``lm_loss + mtp_loss_coeff * mean(mtp_losses)`` (this rank's share under CP; the indexer
    loss is not in it, its gradient flows through the attention outputs). Logged values are detached."""

    loss: Tensor | None = None
    lm_loss: Tensor | None = None
    mtp_losses: list[Tensor] = field(default_factory=list)
    logits: Tensor | None = None
    mtp_logits: list[Tensor] = field(default_factory=list)
    indexer_loss: Tensor | None = None
    num_label_tokens: Tensor | None = None


class DecoderLayer(nn.Module):
    """One block: mHC -> RMSNorm -> HybridAttention -> mHC -> RMSNorm -> MoE, on streams ``[T, n, D]``."""

    def __init__(self, config: DeepseekV4ModelConfig, layer_idx: int, experts: range | None = None) -> None:
        """``experts``: the routed experts (global ids) this block holds, e.g. an expert-parallel rank's share
        (default all)."""
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.recompute = c.recompute
        hashed = layer_idx < c.num_hidden_layers and c.mlp_layer_types[layer_idx] == "hash_moe"
        self.self_attn = HybridAttention(c.attention_config(layer_idx))
        self.mlp = MoE(c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok,
                       c.vocab_size, hashed, c.scoring_func, c.routed_scaling_factor, c.swiglu_limit,
                       backend=c.backend, chunk_rows=c.moe_chunk_rows, local_experts=experts)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn_hc = HyperConnection(c.hidden_size, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps,
                                       backend=c.backend)
        self.ffn_hc = HyperConnection(c.hidden_size, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps,
                                      backend=c.backend)

    @property
    def rebuilds_inputs(self) -> bool:
        """Whether the sub-blocks' normed inputs are rebuilt in the backward rather than kept by their consumers
        (every choice but block recompute, whose checkpoint redoes them anyway)."""
        return self.recompute not in ("block", "full")

    def forward(self, streams: Tensor, input_ids: Tensor, packed: PackedSeqs, cp: ContextParallelGroup | None = None,
                real: Tensor | None = None, indexer_loss_scale: float | Tensor = 1.0,
                streams_again: Callable[[], Tensor] | None = None) -> Tensor:
        """``streams [T, n, D]`` (this rank's rows), ``input_ids [T]`` -> ``[T, n, D]``. ``indexer_loss_scale``:
        the attention's (:meth:`~csattn.layers.attention.HybridAttention.forward`).

        The normed input of each sub-block (``[T, D]``, read by the attention's first projections, or the router,
        the experts and the shared expert) is not kept by them: the backward rebuilds it from the streams, which
        the site keeps anyway (:func:`~csattn.ops.recompute.rebuilt_saves`). ``streams_again``: how to get
        ``streams`` again when the caller does not keep them either (the first block's, from the embedding).
        """
        attn = self._site(self.attn_hc, self.input_layernorm, streams)
        with rebuilt_saves(attn.x, self._again(attn, streams_again or (lambda: streams))):
            y = self.self_attn(attn.x, packed=packed, cp=cp, indexer_loss_scale=indexer_loss_scale)
        mid = self.attn_hc.combine(attn.streams, y, attn.post, attn.comb)
        ffn = self._site(self.ffn_hc, self.post_attention_layernorm, mid)
        with rebuilt_saves(ffn.x, self._again(ffn, lambda: mid)):
            if self.recompute in ("moe", "full") and torch.is_grad_enabled():
                # the MoE holds no collective, so recomputing it never pairs with another rank's call
                y = checkpoint(self.mlp, ffn.x, input_ids, real, use_reentrant=False)
            else:
                y = self.mlp(ffn.x, input_ids=input_ids, real=real)
        return self.ffn_hc.combine(ffn.streams, y, ffn.post, ffn.comb)

    def _site(self, hc: HyperConnection, norm: RMSNorm, streams: Tensor) -> Site:
        """The mHC pre-mapping and the RMSNorm before a sub-block (:func:`~csattn.ops.mhc.hc_site`); under
        ``recompute="mhc"`` (or ``"full"``) only the streams are kept and the site is redone in the backward."""
        if self.recompute in ("mhc", "full") and torch.is_grad_enabled():
            return checkpoint(_pre_and_norm, hc, norm, streams, use_reentrant=False)
        return _pre_and_norm(hc, norm, streams)

    def _again(self, site: Site, streams: Callable[[], Tensor]) -> Callable[[], Tensor] | None:
        """How the backward gets a site's input again (the site's ``again`` on ``streams()``), or None where the
        input is kept: under block recompute, whose checkpoint redoes the whole block anyway. The closure holds
        ``again`` alone, not the site (whose input and streams it would keep alive)."""
        again = site.again
        return (lambda: again(streams())) if self.rebuilds_inputs else None


class MTPBlock(DecoderLayer):
    """Multi-token prediction block ``j``: predicts token ``t + j + 2`` from the streams of the previous depth
    and the embedding of token ``t + j + 1``; shares the embedding and the LM head."""

    def __init__(self, config: DeepseekV4ModelConfig, depth: int, experts: range | None = None) -> None:
        super().__init__(config, config.num_hidden_layers + depth, experts)
        c = config
        self.e_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.h_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        nn.init.normal_(self.e_proj.weight, std=c.initializer_range)
        nn.init.normal_(self.h_proj.weight, std=c.initializer_range)
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hc_head = HyperHead(c.hidden_size, c.hc_mult, c.hc_eps, c.rms_norm_eps, backend=c.backend)

    def forward(self, streams: Tensor, next_embeds: Tensor, input_ids: Tensor, packed: PackedSeqs,
                cp: ContextParallelGroup | None = None, real: Tensor | None = None,
                indexer_loss_scale: float | Tensor = 1.0) -> Tensor:
        """``streams [T, n, D]``, ``next_embeds [T, D]`` (embedding of token t+j+1) -> new streams."""
        mixed = self.e_proj(self.enorm(next_embeds)).unsqueeze(-2) + self.h_proj(self.hnorm(streams))
        return super().forward(mixed, input_ids, packed, cp, real, indexer_loss_scale)


class TopParts(nn.Module):
    """The root unit's modules under their model names (embedding, final norm, hyper-head, LM head), initialized
    as the model initializes them: what the unit-by-unit weight builders draw for the root unit."""

    def __init__(self, c: DeepseekV4ModelConfig) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, c.pad_token_id)
        nn.init.normal_(self.model.embed_tokens.weight, std=c.initializer_range)
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.model.hc_head = HyperHead(c.hidden_size, c.hc_mult, c.hc_eps, c.rms_norm_eps, backend=c.backend)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
            nn.init.normal_(self.lm_head.weight, std=c.initializer_range)


def draw_unit(seed: int, index: int, make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` on the CPU from unit ``index``'s own seed (the host generator forked, so the caller's is left
    as it was); a decoder layer's hash-routing table from a generator of the same seed. Unit 0 is the root
    (:class:`TopParts`), ``1 + i`` decoder layer ``i``, ``1 + num_hidden_layers + j`` MTP block ``j``: the same
    weights whatever builds them (a fresh sharded model, a synthetic checkpoint)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + index)
        module = make()
        if isinstance(module, DecoderLayer):
            module.mlp.gate.init_hash_table(torch.Generator().manual_seed(seed * 1_000_003 + index))
    return module


class _Backbone(nn.Module):
    """HF's ``DeepseekV4Model`` (the ``model.`` prefix)."""

    def __init__(self, config: DeepseekV4ModelConfig) -> None:
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, c.pad_token_id)
        nn.init.normal_(self.embed_tokens.weight, std=c.initializer_range)
        self.layers = nn.ModuleList([DecoderLayer(c, i) for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hc_head = HyperHead(c.hidden_size, c.hc_mult, c.hc_eps, c.rms_norm_eps, backend=c.backend)


class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 language model for training on packed batches.

    Example:
        >>> cfg = DeepseekV4ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, ...)
        >>> model = DeepseekV4ForCausalLM(cfg)
        >>> packed = PackedSeqs.from_lengths([7, 9])
        >>> out = model(ids, packed=packed, labels=future_tokens(ids, packed, 1)[0])
        >>> out.loss.backward()
    """

    def __init__(self, config: DeepseekV4ModelConfig) -> None:
        super().__init__()
        config.validate()
        self.config = c = config
        self.model = _Backbone(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        nn.init.normal_(self.lm_head.weight, std=c.initializer_range)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = nn.ModuleList([MTPBlock(c, j) for j in range(c.num_nextn_predict_layers)])
        # Hash layers need distinct experts per token; checkpoints ship the real table.
        # drawn on the CPU so the model can also be built on the meta device (load_pretrained's skeleton; a
        # meta table has no values to draw)
        seed = int(torch.randint(0, 2**31 - 1, (1,), device="cpu"))
        gen = torch.Generator().manual_seed(seed)
        for module in self.modules():
            if isinstance(module, MoE) and not module.gate.weight.is_meta:
                module.gate.init_hash_table(gen)

    @classmethod
    def from_pretrained(cls, path: str, **overrides: Any) -> DeepseekV4ForCausalLM:
        """Load an HF-format directory (``config.json`` + safetensors); see ``checkpoint.load_pretrained``."""
        from .checkpoint import load_pretrained

        return load_pretrained(path, **overrides)

    def save_pretrained(self, path: str) -> None:
        """Write ``config.json`` + ``model.safetensors`` (HF names)."""
        from .checkpoint import save_pretrained

        save_pretrained(self, path)

    def to_training_dtype(self, dtype: torch.dtype) -> DeepseekV4ForCausalLM:
        """Cast floating parameters to ``dtype`` except the mHC, sinks, position biases, router biases, norm
        weights and RoPE frequencies, which stay fp32 (as in HF and the released checkpoints). Tensors a module
        lists in ``frozen_storage`` (FP8-held weights and their scales) keep their dtype."""
        frozen = {f"{prefix}.{n}" if prefix else n for prefix, m in self.named_modules()
                  for n in getattr(m, "frozen_storage", ())}
        for name, p in list(self.named_parameters()) + list(self.named_buffers()):
            if not p.is_floating_point() or name in frozen:
                continue
            parts = name.split(".")
            keep = any(part in FP32_MODULES or part.endswith("norm") for part in parts) or parts[-1] == "inv_freq"
            # "keep in fp32" means at least fp32: an fp64 model stays fp64 throughout
            p.data = p.data.to(torch.promote_types(dtype, torch.float32) if keep else dtype)
        return self

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: Tensor,
        packed: Any = None,
        cp: ContextParallelGroup | None = None,
        labels: Tensor | None = None,
        mtp_labels: Tensor | None = None,
        label_counts: Tensor | None = None,
        return_logits: bool = True,
        indexer_loss_scale: float | Tensor = 1.0,
    ) -> CausalLMOutput:
        """Args:
            input_ids: ``[T]`` int64 token ids (this rank's rows under ``cp``).
            packed: :class:`PackedSeqs` (or Megatron ``PackedSeqParams``) of the **global** stream; None = one
                document.
            cp: optional ``csattn.ContextParallel``; ``input_ids`` and the labels are ``cp.shard(...)`` of the
                global tensors.
            labels: ``[T]`` next-token ids (``IGNORE_INDEX`` = no loss), e.g. ``future_tokens(...)[0]``. MTP
                block 0 embeds these as its "next token" input.
            mtp_labels: ``[num_mtp, T]`` labels of the MTP blocks (``future_tokens(...)[1:]``); derived from
                ``labels`` when omitted (single process only).
            label_counts: ``[1 + num_mtp]`` number of labelled rows over the whole (global) stream, the loss
                denominators. Defaults to the local counts, summed over the CP group.
            return_logits: keep the ``[T, V]`` logits in the output. Without them the loss runs over row chunks
                whose logits are recomputed in the backward, so ``[T, V]`` is never stored.
            indexer_loss_scale: the gradient every CSA layer's backward sends into its indexer loss: the scale of
                the caller's loss (e.g. this micro-batch's share of the step); a 0-d tensor is read in the backward.
        Returns:
            :class:`CausalLMOutput`.
        """
        c = self.config
        ids = self._check_ids(input_ids)
        t = ids.shape[0]
        packed = self._packed(packed, t, cp)
        real = self._local_real(packed, t, cp, ids.device)
        final, streams = self._decoder(self.model.embed_tokens(ids), ids, packed, cp, real, indexer_loss_scale)
        logits = self.lm_head(final) if return_logits else None

        out = CausalLMOutput(logits=logits)
        losses: list[Tensor] = []
        if labels is not None:
            labels = self._check_labels(labels, t, "labels")
            targets = [labels]
            if len(self.mtp):
                if mtp_labels is None:
                    if cp is not None:
                        raise ValueError("mtp_labels is required under context parallelism (the shift crosses "
                                         "rank cuts); pass future_tokens(global_ids, packed, 1 + num_mtp)[1:] "
                                         "sharded like the rows")
                    mtp_labels = _shift_labels(labels, len(self.mtp))
                mtp_labels = self._check_labels(mtp_labels, t, "mtp_labels", rows=len(self.mtp))
                targets += list(mtp_labels)
            counts = self._label_counts(targets, label_counts, cp)
            out.num_label_tokens = counts.detach()
            losses.append(self._ce_sum(final, logits, labels) / counts[0].clamp_min(1))

            h = streams
            for j, block in enumerate(self.mtp):
                next_ids = targets[j].clamp_min(0)  # token t+j+1 (rows without one have no MTP label)
                h = self._run_block(block, h, self.model.embed_tokens(next_ids), ids, packed, cp, real,
                                    indexer_loss_scale)
                mtp_final = block.hc_head(h, block.norm)
                mtp_logits = self.lm_head(mtp_final) if return_logits else None
                if mtp_logits is not None:
                    out.mtp_logits.append(mtp_logits)
                losses.append(self._ce_sum(mtp_final, mtp_logits, targets[j + 1]) / counts[j + 1].clamp_min(1))
            out.lm_loss = losses[0].detach()
            out.mtp_losses = [x.detach() for x in losses[1:]]
            loss = losses[0]
            if len(losses) > 1:
                loss = loss + c.mtp_loss_coeff * torch.stack(losses[1:]).mean()
            out.loss = loss
        indexer = [m.last_indexer_loss for m in self.modules()
                   if isinstance(m, HybridAttention) and m.last_indexer_loss is not None]
        if indexer:
            out.indexer_loss = torch.stack([x.float() for x in indexer]).sum()
        return out

    # ------------------------------------------------------------------ MoE balancing
    def expert_loads(self) -> list[Tensor]:
        """``[E]`` real-token counts of every learned-routing MoE layer from the last forward."""
        return [m.last_load for m in self.modules() if isinstance(m, MoE) and not m.gate.hashed
                and m.last_load is not None]

    def update_router_biases(self, loads: list[Tensor], rate: float) -> None:
        """Apply :meth:`Router.update_bias` with ``loads`` from :meth:`expert_loads` (summed over ranks)."""
        moes = [m for m in self.modules() if isinstance(m, MoE) and not m.gate.hashed]
        if len(moes) != len(loads):
            raise ValueError(f"loads has {len(loads)} entries for {len(moes)} learned-routing MoE layers")
        for moe, load in zip(moes, loads):
            moe.gate.update_bias(load, rate)

    # ------------------------------------------------------------------ helpers
    loss_chunk_rows = 4096

    def _decoder(self, embeds: Tensor, ids: Tensor, packed: PackedSeqs, cp: ContextParallelGroup | None,
                 real: Tensor, indexer_loss_scale: float | Tensor = 1.0) -> tuple[Tensor, Tensor | None]:
        """``embeds [T, D]`` -> the final normed hidden ``[T, D]`` and the last streams ``[T, n, D]`` (what the MTP
        blocks continue from; None when the last block ends with the head, see below).

        The first block expands the embedding into the ``n`` streams itself and, under block recompute without
        MTP blocks, the last one ends with the hyper-head and the final norm: the model then keeps the embedding
        ``[D]`` rather than its ``n`` copies, and the head's output rather than the last streams (24 and 32
        stream-dtype elements a token fewer, 12 + 16 GiB at 512k tokens of the V4-Flash geometry).
        """
        n = self.config.hc_mult
        layers = list(self.model.layers)
        if not layers:
            streams = expand_streams(embeds, n)
            return self.model.hc_head(streams, self.model.norm), streams
        head_inside = self.config.recompute in ("block", "full") and not len(self.mtp)
        h = embeds
        for i, layer in enumerate(layers):
            head = self.model if head_inside and i == len(layers) - 1 else None
            step = partial(_block_step, layer, n if i == 0 else 0, head)
            h = self._run_block(step, h, ids, packed, cp, real, indexer_loss_scale, offload=True)
        if head_inside:
            return h, None
        return self.model.hc_head(h, self.model.norm), h

    def _run_block(self, block: Callable[..., Tensor], *args: Any, offload: bool = False) -> Tensor:
        """One decoder / MTP block, recomputed in the backward under ``recompute="block"`` or ``"full"``; with
        ``offload`` (a block whose only differentiable input is its first argument) and ``offload_block_inputs``
        that input waits in host memory (:class:`_HostCheckpoint`).

        Every rank of a CP group recomputes the same blocks in the same order, so the collectives inside the
        attention (halo exchange, entry gather) pair up again during the backward.
        """
        if self.config.recompute in ("block", "full") and torch.is_grad_enabled():
            if offload and self.config.offload_block_inputs:
                return _HostCheckpoint.apply(block, *args)
            return checkpoint(block, *args, use_reentrant=False)
        return block(*args)

    def _ce_sum(self, hidden: Tensor, logits: Tensor | None, labels: Tensor) -> Tensor:
        """Summed CE of the head on ``hidden [T, D]`` (or of the given ``logits``)."""
        if logits is not None:
            return _ce_sum(logits, labels)
        total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        # every chunk runs, labelled or not (a chunk without labels adds 0): asking which have labels would make
        # the host wait for the device in the middle of the step
        for start in range(0, hidden.shape[0], self.loss_chunk_rows):
            rows = slice(start, start + self.loss_chunk_rows)
            total = total + checkpoint(_head_ce_sum, hidden[rows], self.lm_head.weight, labels[rows],
                                       use_reentrant=False)
        return total

    def _check_ids(self, input_ids: Tensor) -> Tensor:
        if not isinstance(input_ids, Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError("input_ids must be an int32/int64 tensor [T]")
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be packed [T], got shape {tuple(input_ids.shape)}")
        if input_ids.numel():
            lo, hi = torch.stack(torch.aminmax(input_ids)).tolist()  # one host read
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"input_ids must be in [0, vocab_size={self.config.vocab_size}), got values in "
                                 f"[{lo}, {hi}]")
        return input_ids.long()

    def _check_labels(self, labels: Tensor, t: int, name: str, rows: int | None = None) -> Tensor:
        shape = (t,) if rows is None else (rows, t)
        if not isinstance(labels, Tensor) or tuple(labels.shape) != shape:
            got = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
            raise ValueError(f"{name} must have shape {shape}, got {got}")
        return labels.long()

    def _packed(self, packed: Any, t: int, cp: ContextParallelGroup | None) -> PackedSeqs:
        if packed is None:
            if cp is not None:
                raise ValueError("packed is required under context parallelism (it describes the global stream)")
            return PackedSeqs.uniform(1, t)
        return PackedSeqs.coerce(packed)

    def _local_real(self, packed: PackedSeqs, t: int, cp: ContextParallelGroup | None, device: torch.device) -> Tensor:
        real = packed.rows(device).real
        if cp is None:
            return real
        local = cp.local_rows(packed, device)  # global row of each local row (any partition)
        if local.shape[0] != t:
            raise ValueError(f"input_ids has {t} rows but this rank owns {local.shape[0]} rows of the stream")
        return real[local]

    def _label_counts(self, targets: list[Tensor], given: Tensor | None, cp: ContextParallelGroup | None) -> Tensor:
        if given is not None:
            counts = torch.as_tensor(given, dtype=torch.float32, device=targets[0].device).reshape(-1)
            if counts.numel() != len(targets):
                raise ValueError(f"label_counts must have {len(targets)} entries, got {counts.numel()}")
            return counts
        counts = torch.stack([(x != IGNORE_INDEX).sum() for x in targets]).float()
        if cp is not None:
            import torch.distributed as dist

            dist.all_reduce(counts, group=cp.group)
        return counts


class _HostCheckpoint(torch.autograd.Function):
    """Block recompute with the block's input kept in (pinned) host memory, copied back to the device for the
    recomputation in the backward (``offload_block_inputs``).

    torch's non-reentrant checkpoint holds its inputs on the device until the backward, and they are what block
    recompute keeps (one stream set ``[T, n, D]`` per block: 64 GiB at 512k tokens of the V4-Flash proxy). The
    forward runs with autograd on, like the checkpointed forward, so that the layers compute and log what they
    compute under autograd (the indexer loss), and drops that graph at once; the backward runs the block again and
    back-propagates through it (the reentrant scheme), so every rank of a CP group redoes its collectives in the
    same order.
    """

    @staticmethod
    def forward(ctx, run, x, *args):
        ctx.run, ctx.args, ctx.device = run, args, x.device
        # the backward runs outside the forward's autocast region: keep its state (the CPU's and the device's) so
        # the recomputation casts exactly as the forward did (else its activations, and the gradients, differ)
        ctx.autocast = _autocast_state(x.device.type)
        host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=x.is_cuda)
        host.copy_(x, non_blocking=x.is_cuda)  # stream-ordered: x's memory is reused only after the copy
        ctx.host = host
        with torch.enable_grad():
            out = run(x.detach(), *args)
        return out.detach()

    @staticmethod
    def backward(ctx, dout):
        x = ctx.host.to(ctx.device, non_blocking=True).requires_grad_()
        ctx.host = None
        with torch.enable_grad(), ExitStack() as stack:
            for device_type, kwargs in ctx.autocast.items():
                stack.enter_context(torch.autocast(device_type, **kwargs))
            out = ctx.run(x, *ctx.args)
        torch.autograd.backward(out, dout)
        return (None, x.grad, *([None] * len(ctx.args)))


def _autocast_state(device_type: str) -> dict[str, dict[str, Any]]:
    """The autocast settings in force for the CPU and ``device_type``, as ``torch.autocast`` keyword arguments."""
    return {d: dict(enabled=torch.is_autocast_enabled(d), dtype=torch.get_autocast_dtype(d),
                    cache_enabled=torch.is_autocast_cache_enabled())
            for d in dict.fromkeys(("cpu", device_type))}


def _block_step(layer: DecoderLayer, expand: int, head: nn.Module | None, x: Tensor, *args: Any) -> Tensor:
    """One decoder block as the unit of block recompute: ``x`` is the streams ``[T, n, D]``, or the embedding
    ``[T, D]`` copied into ``expand`` streams first (which the backward then copies again rather than keep: the
    embedding is ``n`` times smaller); with ``head`` (the backbone) it returns the final normed hidden ``[T, D]``
    instead of the streams."""
    if not expand:
        out = layer(x, *args)
    else:
        streams = expand_streams(x, expand)
        again = partial(expand_streams, x.detach(), expand) if layer.rebuilds_inputs else None
        with rebuilt_saves(streams, again):
            out = layer(streams, *args, streams_again=again)
    return head.hc_head(out, head.norm) if head is not None else out


def _pre_and_norm(hc: nn.Module, norm: nn.Module, streams: Tensor) -> Site:
    return hc(streams, norm)  # the site applies the norm itself (its collapse is recomputed, not kept)


def _ce_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Summed cross entropy in fp32 (fp64 for fp64 logits) over rows whose label is not ``IGNORE_INDEX``."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.to(compute), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _head_ce_sum(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype:
        return _ce_sum(_WideLogits.apply(hidden, weight), labels)
    return _ce_sum(F.linear(hidden, weight), labels)


class _WideLogits(torch.autograd.Function):
    """``hidden [R, D] @ weight [V, D]^T`` as fp32 logits straight from the GEMM's fp32 accumulators: no
    ``[R, V]`` logits rounded to bf16 and then copied to fp32 for the softmax (CUDA)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(hidden, weight)
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, weight = ctx.saved_tensors
        g = grad.to(hidden.dtype)
        dh = g @ weight if ctx.needs_input_grad[0] else None
        dw = g.t() @ hidden if ctx.needs_input_grad[1] else None
        return dh, dw


def _shift_labels(labels: Tensor, depth: int) -> Tensor:
    """``[depth, T]``: label of row t+j for j = 1..depth when row t has one (same document), else ignored."""
    out, prev = [], labels
    for _ in range(depth):
        nxt = torch.full_like(prev, IGNORE_INDEX)
        nxt[:-1] = torch.where(prev[:-1] != IGNORE_INDEX, prev[1:], nxt[:-1])
        out.append(nxt)
        prev = nxt
    return torch.stack(out)
