"""``HybridAttention``: one DeepSeek-V4 attention layer (sliding window, CSA or HCA) on packed sequences."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch
from torch import Tensor, nn

from ..amp import autocast_dtype, autocast_off, low_precision_parameters
from ..config import AttentionConfig
from ..ops.autograd import with_zero_grads
from ..ops.backend import resolve_backend
from ..ops.indexer_loss import SparseTeacher, attach_indexer_loss, indexer_kl_from_teacher, sparse_teacher_block
from ..ops.indices import combine_indices, range_indices
from ..ops.rope import apply_rope, rope_cos_sin, rope_inv_freq
from ..packing import PackedSeqs
from .core import BlockIds, CoreGeometry, attention_core, output_projection, query_heads
from .modules import Compressor, GroupedLinear, Indexer, Projection, RMSNorm, RowPieces, _linear, map_rows
from .op_sets import EAGER, OpSet
from .plan import LOCAL, CompressedRange, IndexerLossInputs, LayerPlan, Packed, Planner

__all__ = ["HybridAttention"]

_INDEXER_Q = "compressor.indexer.q_b_proj"


class _CSACompressor(Compressor):
    """The CSA compressor owns the indexer (HF layout: ``compressor.indexer.*``)."""

    def __init__(self, cfg: AttentionConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.head_dim, cfg.compress_ratio, overlap=True, eps=cfg.rms_norm_eps)
        self.indexer = Indexer(cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim,
                               cfg.compress_ratio, cfg.rms_norm_eps)


def _window_block(window_ids: Tensor, lo: int, hi: int) -> Tensor:
    return window_ids[lo:hi]


def _selected_block(window_ids: Tensor, selected: Tensor, lo: int, hi: int, raw_rows: int) -> Tensor:
    return combine_indices(window_ids[lo:hi], selected[lo:hi], raw_rows)


def _range_block(window_ids: Tensor, start: Tensor, end: Tensor, lo: int, hi: int, raw_rows: int,
                 width: int) -> Tensor:
    return combine_indices(window_ids[lo:hi], range_indices(start[lo:hi], end[lo:hi], width), raw_rows)


class HybridAttention(nn.Module):
    """DeepSeek-V4 attention for training on packed sequences.

    Forward takes ``[B, S, D]`` (B documents of length S) or packed ``[T, D]`` with ``packed=`` a
    :class:`csattn.PackedSeqs` or any object with Megatron ``PackedSeqParams`` fields. It returns the
    output of the same shape. On CSA layers with gradients enabled the indexer KL loss is computed,
    attached to the output (its gradient flows during the main backward) and kept, detached, in
    ``self.last_indexer_loss`` for logging.

    Example:
        >>> cfg = AttentionConfig(hidden_size=64, num_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=32,
        ...                       o_groups=2, o_lora_rank=16, sliding_window=8, layer_type="csa",
        ...                       index_n_heads=2, index_head_dim=16, index_topk=4)
        >>> attn = HybridAttention(cfg)
        >>> out = attn(torch.randn(2, 40, 64))
    """

    # the projections whose weights the layer reads (see projection); every other linear it calls as a module
    READ_PROJECTIONS = ("q_b_proj", "o_a_proj", "o_b_proj", "compressor.indexer.q_b_proj")

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__()
        config.validate()
        self.config = cfg = config
        hd = cfg.num_heads * cfg.head_dim
        self.q_a_proj = _linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = _linear(cfg.q_lora_rank, hd)
        self.kv_proj = _linear(cfg.hidden_size, cfg.head_dim)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups)
        self.o_b_proj = _linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads))
        if cfg.layer_type == "csa":
            self.compressor: Compressor | None = _CSACompressor(cfg)
        elif cfg.layer_type == "hca":
            self.compressor = Compressor(cfg.hidden_size, cfg.head_dim, cfg.compress_ratio, overlap=False,
                                         eps=cfg.rms_norm_eps)
        else:
            self.compressor = None
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False
        )
        self.last_indexer_loss: Tensor | None = None

    # ------------------------------------------------------------------ public API
    def forward(self, hidden_states: Tensor, packed: Packed | None = None, cp: Planner | None = None,
                indexer_loss_scale: float | Tensor = 1.0) -> Tensor:
        """Args:
            hidden_states: ``[B, S, D]`` or packed ``[T, D]`` (the normalized block input).
            packed: packed metadata for ``[T, D]`` input (None = one document). Under ``cp`` it describes
                the global stream and ``hidden_states`` holds this rank's rows.
            cp: optional ``csattn.ContextParallel`` (any :class:`~csattn.layers.plan.Planner`).
            indexer_loss_scale: the gradient the backward sends into the attached indexer loss, the scale of the
                caller's main loss (e.g. ``1 / num_microbatches``); a number, or a 0-d tensor read in the backward.

        Returns:
            ``[B, S, D]`` or ``[T, D]``, like the input. Input without rows (``T = 0``, ``B = 0`` or ``S = 0``:
            an empty pack) gives an output without rows. Under ``torch.autocast`` the layer runs in the autocast
            dtype as a layer cast to it would, and returns that dtype (see :mod:`csattn.amp`).
        """
        low = autocast_dtype(hidden_states) if isinstance(hidden_states, Tensor) else None
        if low is not None:
            # autocast's dtypes decided once for the whole layer: its fused ops recompute in the backward, where
            # autocast is off
            x = hidden_states.to(low) if hidden_states.is_floating_point() else hidden_states
            with autocast_off(hidden_states), low_precision_parameters(self, low):
                return self.forward(x, packed, cp, indexer_loss_scale)
        if isinstance(hidden_states, Tensor) and hidden_states.dim() in (2, 3) and not hidden_states.shape[:-1].numel():
            return self._empty_forward(hidden_states, packed, cp)
        if cp is not None and not callable(getattr(cp, "plan", None)):  # a Planner (no isinstance: traced code)
            raise ValueError(f"cp= must be a csattn.ContextParallel, got {type(cp).__name__}")
        x, packed, batch_shape = self._flatten(hidden_states, packed, cp)
        out = self.forward_plan(x, (LOCAL if cp is None else cp).plan(x, packed, self.config), indexer_loss_scale)
        return out.view(*batch_shape, -1) if batch_shape is not None else out

    def forward_plan(self, x: Tensor, plan: LayerPlan, indexer_loss_scale: float | Tensor = 1.0) -> Tensor:
        """The one flow of the layer over this rank's rows ``x [L, D]``; ``plan`` says what differs between the
        single-process, context-parallel and capture-safe runs (see ``layers/README.md``). Each exchange is
        started before, and finished after, a phase that does not need it, so the collective overlaps it.
        ``indexer_loss_scale``: see :meth:`forward`."""
        cfg, ops, exchange, entries = self.config, plan.ops, plan.exchange, plan.entries
        if plan.padding:
            # Padding is not data (a collator may leave uninitialized memory there): zeroed before any projection,
            # or a NaN there would reach every weight gradient as 0 * NaN. Each rank zeroes its own rows before the
            # halo exchange, so halos arrive zeroed too. Saved for the backward in place of x (packs with padding).
            x = x.masked_fill(~plan.real[:, None], 0)
        halo = exchange.start_halo(x)
        cos, sin = self._rope_tables(plan.pos, x.dtype)
        qr = self._query_latent(x)  # overlaps the halo exchange
        x_ext = exchange.finish_halo(x, halo)
        pending = None
        if entries is not None:  # this rank's entries: compressed KV and (CSA) the indexer's own keys
            backend = self._backend_for(x)
            parts = [ops.compress(self.compressor, x_ext, entries, self.inv_freq, backend)]
            if cfg.layer_type == "csa":  # from detached rows: the indexer learns from its loss only
                parts.append(ops.compress(self.compressor.indexer, x_ext.detach(), entries, self.inv_freq, backend))
            pending = exchange.start_entries(parts)
        cos_e, sin_e = (cos, sin) if plan.pos_ext is None else self._rope_tables(plan.pos_ext, x.dtype)
        kv = self._raw_kv(x_ext, cos_e, sin_e)  # overlaps the entry gather

        ckv = compressed_ids = loss = None
        if entries is not None:
            ckv, *keys = exchange.finish_entries(pending)  # every entry, global id order
            if cfg.layer_type == "hca":
                # expanded one row chunk at a time inside attend: never [T, T / r] ids at once
                compressed_ids = CompressedRange(entries.vis_start, entries.vis_end, entries.max_visible)
            else:
                compressed_ids, loss = self._select(x, qr, cos, sin, keys[0], plan)
        out = self._heads(qr, cos, sin, kv, ckv, plan.window_ids, compressed_ids, loss, ops, indexer_loss_scale)
        if self.compressor is not None and (entries is None or entries.meta.entry_row.numel() == 0):
            # no whole window in this rank's rows: the compressor pooled nothing, but every rank of an FSDP mesh
            # must reduce the same gradients, so its parameters get zeros rather than none (a shape, no sync)
            out = with_zero_grads(out, list(self.compressor.parameters()))
        return out

    def load_hf_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True) -> None:
        """Load the state dict of a Hugging Face ``DeepseekV4Attention`` (same names).

        Raises ``ValueError`` naming the tensor on a missing, unexpected or misshaped entry.
        """
        own = self.state_dict()
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        for name, tensor in state_dict.items():
            if name in own and tuple(own[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} does not match the config's "
                    f"{tuple(own[name].shape)}"
                )
        with torch.no_grad():
            for name, tensor in state_dict.items():
                if name in own:
                    own[name].copy_(tensor)

    def projection(self, name: str) -> Projection:
        """What the layer multiplies by for projection ``name``: one of :attr:`READ_PROJECTIONS`, the projections
        whose weights the fused paths read (block-recomputed core, row-chunked queries) instead of calling the
        module; the layer calls the other projections as modules. Here the module's weight; a subclass may add a
        low-rank term (``csattn.finetune.lora.LoraReader``: LoRA's pair, run factored) or return an effective
        weight (the HF integration's PEFT adapters)."""
        return Projection(self.get_submodule(name).weight)

    # ------------------------------------------------------------------ phases (private; the flow above runs them)
    def _rope_tables(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(pos, self.inv_freq, torch.promote_types(dtype, torch.float32))

    def _query_latent(self, x: Tensor) -> Tensor:
        """The shared query latent ``qr [T, q_lora]`` (``q_a_proj`` then RMSNorm)."""
        return self.q_a_norm(self.q_a_proj(x))

    def _queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """``q [T, H, d]`` (normed, roped) and the shared latent ``qr [T, q_lora]``."""
        qr = self._query_latent(x)
        return self._query_heads(qr, cos, sin), qr

    def _query_heads(self, qr: Tensor, cos: Tensor, sin: Tensor, ops: OpSet = EAGER) -> Tensor:
        """``q [T, H, d]`` from the latent; block-recomputed in the backward with ``recompute_projections``."""
        cfg = self.config
        if not cfg.recompute_projections:
            return query_heads(qr, cos, sin, self.projection("q_b_proj"), cfg.num_heads, cfg.rms_norm_eps)
        return ops.query_heads(qr, cos, sin, self.projection("q_b_proj"), cfg.num_heads, cfg.rms_norm_eps,
                               self._recompute_rows())

    def _raw_kv(self, x: Tensor | RowPieces, cos: Tensor, sin: Tensor) -> Tensor:
        """The single K = V head of every row, ``[T, d]``."""
        return apply_rope(self.kv_norm(map_rows(self.kv_proj, x)), cos, sin)

    def _output(self, o: Tensor, cos: Tensor, sin: Tensor, ops: OpSet = EAGER) -> Tensor:
        """Inverse RoPE on ``o [T, H, d]`` (values carried absolute rope), then the grouped projection."""
        cfg = self.config
        projections = (self.projection("o_a_proj"), self.projection("o_b_proj"))
        if not cfg.recompute_projections:
            return output_projection(o, cos, sin, *projections, groups=cfg.o_groups)
        return ops.output(o, cos, sin, *projections, cfg.o_groups, self._recompute_rows())

    def _recompute_rows(self) -> int:
        """Rows per recomputed block: about a quarter of the workspace for ~4 fp32 ``[H, d]`` temporaries."""
        cfg = self.config
        return max(16, (cfg.workspace_bytes // 4) // (cfg.num_heads * cfg.head_dim * 16))

    def _attend(
        self,
        q: Tensor,
        kv: Tensor,
        ckv: Tensor | None,
        window_ids: Tensor,
        compressed_ids: Tensor | CompressedRange | None,
        ops: OpSet = EAGER,
    ) -> tuple[Tensor, Tensor]:
        """Sparse attention of ``q`` over window keys (rows of ``kv``) and compressed keys (rows of ``ckv``).

        ``compressed_ids`` is a ``[T, k]`` id matrix (CSA top-k) or a :class:`CompressedRange` (HCA: every
        visible entry). A range is expanded to ids one row chunk at a time, so the index lists never take
        ``T * T / r`` memory. ``ops`` runs the sparse attention (eager, or its custom op).
        """
        cfg = self.config
        backend = self._backend_for(q)

        def run(q_: Tensor, keys: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
            return ops.sparse_attn(q_, keys, ids, self.sinks, cfg.scale, cfg.attn_chunk_rows, backend,
                                   cfg.sparse_attn_kernel)

        keys, ids_fn = self._key_ids(kv, ckv, window_ids, compressed_ids)
        total = q.shape[0]
        if not isinstance(compressed_ids, CompressedRange):
            return run(q, keys, ids_fn(0, total))
        step = max(1, (cfg.workspace_bytes // 8) // (window_ids.shape[1] + max(compressed_ids.width, 1)))
        if step >= total:
            return run(q, keys, ids_fn(0, total))
        parts = [run(q[lo:lo + step], keys, ids_fn(lo, min(lo + step, total))) for lo in range(0, total, step)]
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])

    def _backend_for(self, t: Tensor | RowPieces) -> str:
        """``"triton"`` on CUDA by default (``backend="auto"``), the reference elsewhere."""
        return resolve_backend(self.config.backend, t.pieces[-1] if isinstance(t, RowPieces) else t)

    def _indexer_query_rows(self) -> int:
        """Rows per chunk of the indexer queries: their projection and fp32 RoPE temporaries (~16 bytes per
        channel) within the workspace."""
        cfg = self.config
        return max(64, cfg.workspace_bytes // (16 * cfg.index_n_heads * cfg.index_head_dim))

    def _wants_indexer_loss(self) -> bool:
        return (
            self.config.layer_type == "csa"
            and self.config.compute_indexer_loss
            and torch.is_grad_enabled()
        )

    def _heads(
        self,
        qr: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv: Tensor,
        ckv: Tensor | None,
        window_ids: Tensor,
        compressed_ids: Tensor | CompressedRange | None,
        loss: IndexerLossInputs | None,
        ops: OpSet = EAGER,
        loss_scale: float | Tensor = 1.0,
    ) -> Tensor:
        """Everything per head, from the query latent to the layer output ``[T, D]``: query heads, sparse
        attention over window + compressed keys, the indexer loss (attached to the output) and the output
        projection.

        With ``recompute_projections`` (the default) this runs block by block in :func:`attention_core`, and
        no ``[T, H, d]`` tensor is ever whole; the dense indexer loss needs all queries at once, so it takes
        the unblocked path (queries and output projection still recomputed block by block), and so does the
        capture-safe op set where it must (see :meth:`~csattn.layers.op_sets.EagerOps.unblocked`).
        ``loss_scale``: the indexer loss's gradient scale (:meth:`forward`'s ``indexer_loss_scale``). Nothing here
        reads device values on the host.
        """
        cfg = self.config
        self.last_indexer_loss = None
        want_loss = loss is not None and ckv is not None and self._wants_indexer_loss()
        if not cfg.recompute_projections or ops.unblocked(cfg.layer_type, cfg.indexer_loss_type, want_loss):
            q = self._query_heads(qr, cos, sin, ops)
            o, lse = self._attend(q, kv, ckv, window_ids, compressed_ids, ops)
            if want_loss:
                o = self._with_indexer_loss(o, loss, q, ckv, lse, compressed_ids, loss_scale, ops)
            return self._output(o, cos, sin, ops)

        keys, ids_fn = self._key_ids(kv, ckv, window_ids, compressed_ids)
        backend = self._backend_for(qr)
        geo = CoreGeometry(heads=cfg.num_heads, groups=cfg.o_groups, eps=cfg.rms_norm_eps, scale=cfg.scale,
                           block_rows=self._core_block_rows(window_ids, compressed_ids), backend=backend,
                           ref_chunk_rows=cfg.attn_chunk_rows, sparse_attn=cfg.sparse_attn_kernel)
        on_block = teacher = None
        if want_loss:
            row_weight = loss.row_weight(torch.promote_types(qr.dtype, torch.float32))
            teacher = SparseTeacher(qr.shape[0], compressed_ids.shape[1], row_weight.dtype, qr.device,
                                    backend=backend)

            def on_block(lo: int, hi: int, q: Tensor, lse: Tensor) -> None:
                sparse_teacher_block(teacher, lo, loss.q_idx[lo:hi], loss.w[lo:hi], loss.k_idx, q, ckv, lse,
                                     cfg.scale, row_weight[lo:hi], compressed_ids[lo:hi], backend=backend,
                                     config=cfg.indexer_loss_kernel)

        projections = tuple(self.projection(name) for name in ("q_b_proj", "o_a_proj", "o_b_proj"))
        out = attention_core(qr, cos, sin, keys, self.sinks, *projections, ids_fn, geo, on_block)
        if teacher is not None:
            # the backward recomputes the indexer queries block by block instead of keeping q_idx [T, HI, cI]
            queries = self.compressor.indexer.student_queries(qr.detach(), cos, sin, self._indexer_query_rows(),
                                                              backend=backend,
                                                              q_b=self.projection(_INDEXER_Q))
            kl = indexer_kl_from_teacher(queries, loss.w, loss.k_idx, teacher, row_weight, compressed_ids,
                                         workspace_bytes=cfg.workspace_bytes, backend=backend,
                                         config=cfg.indexer_loss_kernel)
            self.last_indexer_loss = kl.detach()
            out = attach_indexer_loss(out, kl * cfg.indexer_loss_coeff, loss_scale)
        return out

    def _key_ids(
        self, kv: Tensor, ckv: Tensor | None, window_ids: Tensor, compressed_ids: Tensor | CompressedRange | None
    ) -> tuple[Tensor, BlockIds]:
        """The key rows ``[kv; ckv]`` and ``ids_fn(lo, hi)`` giving rows ``lo..hi``'s ids into them."""
        if ckv is None or ckv.shape[0] == 0 or compressed_ids is None:
            return kv, BlockIds(_window_block, (window_ids,))
        keys = torch.cat([kv, ckv.to(kv.dtype)], dim=0)
        n = kv.shape[0]
        if isinstance(compressed_ids, Tensor):
            return keys, BlockIds(partial(_selected_block, raw_rows=n), (window_ids, compressed_ids))
        start, end, width = compressed_ids
        return keys, BlockIds(partial(_range_block, raw_rows=n, width=width), (window_ids, start, end))

    def _core_block_rows(self, window_ids: Tensor, compressed_ids: Tensor | CompressedRange | None) -> int:
        """Rows per block of the fused core: its per-head temporaries (``q``, ``o``, ``do``, ``dq``, the
        projection outputs around them and, on the reference backend, fp32 RMSNorm / RoPE temporaries: about
        16 bytes per head channel with the Triton kernels, 24 without) and the block's int64 ids within the
        workspace."""
        cfg = self.config
        per_channel = 16 if self._backend_for(window_ids) == "triton" else 24
        width = window_ids.shape[1]
        if isinstance(compressed_ids, CompressedRange):
            width += compressed_ids.width
        elif compressed_ids is not None:
            width += compressed_ids.shape[1]
        per_row = cfg.num_heads * cfg.head_dim * per_channel + width * 8
        rows = max(16, cfg.workspace_bytes // per_row)
        return rows if rows < 256 else rows // 128 * 128  # whole waves of row programs on the GPU

    def _effective_topk(self, max_visible: int) -> int:
        """Width of the top-k lists: ``index_topk`` capped by the most entries any row can see (HF's
        ``min(index_topk, compressed_len)``). Columns past that are -1 on every row, so dropping them changes
        no result, while keeping them would make every per-row tensor (ids, gathered keys, teacher masses)
        grow with ``index_topk`` itself. ``max_visible`` is a host int: the widest visible range of the pack,
        or its static bound on the capture-safe path. At least 1 (the top-k needs a column)."""
        return max(1, min(self.config.index_topk, int(max_visible)))

    def _select(self, x: Tensor, qr: Tensor, cos: Tensor, sin: Tensor, index_keys: Tensor,
               plan: LayerPlan) -> tuple[Tensor, IndexerLossInputs]:
        """Lightning-indexer top-k for the local rows of ``x`` / ``qr`` (CSA) over ``index_keys [Nc, cI]``.

        The indexer sees detached inputs: the language-model loss sends it no gradient; only the
        indexer loss trains it. The list width is capped by the widest visible range of the stream.

        Returns:
            ``selected [L, k]`` global compressed ids (-1 = none) and the indexer loss's inputs.
        """
        cfg, entries = self.config, plan.entries
        indexer: Indexer = self.compressor.indexer
        q_idx = indexer.queries(qr.detach(), cos, sin, chunk_rows=self._indexer_query_rows(),
                                backend=self._backend_for(qr), q_b=self.projection(_INDEXER_Q))
        w = indexer.scorer(x.detach())
        selected = plan.ops.indexer_topk(q_idx, w, index_keys, entries.vis_start, entries.vis_end,
                                         self._effective_topk(entries.max_visible), entries.max_visible,
                                         cfg.workspace_bytes, self._backend_for(q_idx), cfg.indexer_kernel)
        return selected, IndexerLossInputs(q_idx, w, index_keys, plan.real, plan.num_real, entries.vis_start,
                                           entries.vis_end, entries.max_visible)

    def _with_indexer_loss(self, o: Tensor, loss: IndexerLossInputs, q: Tensor, ckv: Tensor, lse: Tensor,
                          selected: Tensor, loss_scale: float | Tensor = 1.0, ops: OpSet = EAGER) -> Tensor:
        """Attach ``coeff * sum_t KL_t / num_real`` over the real rows to ``o`` (its gradient flows in ``o``'s
        backward) and log the KL in ``last_indexer_loss``.

        ``loss.num_real`` is the number of real rows of the whole stream (global under context parallelism, so
        the ranks' losses sum to the single-process loss).
        """
        cfg = self.config
        kl = ops.indexer_kl_loss(loss, q, ckv, lse, cfg.scale, selected if cfg.indexer_loss_type == "sparse" else None,
                                 cfg.workspace_bytes, self._backend_for(loss.q_idx), cfg.indexer_loss_kernel)
        self.last_indexer_loss = kl.detach()
        return attach_indexer_loss(o, kl * cfg.indexer_loss_coeff, loss_scale)

    # ------------------------------------------------------------------ input handling
    def _empty_forward(self, hidden_states: Tensor, packed: Packed | None, cp: Planner | None) -> Tensor:
        """No rows in, no rows out (an empty pack, e.g. a data loader's last batch): every position-dependent
        step would divide by or index into zero documents, so nothing is computed. The output is still a
        function of ``hidden_states`` so that a backward through it runs (and gives empty gradients)."""
        self._check_input(hidden_states)
        if packed is not None and hidden_states.dim() == 3:
            raise ValueError("packed= is for [T, D] input; got [B, S, D] hidden_states")
        if packed is not None:
            if getattr(packed, "capture_safe", False):
                rows = int(packed.num_rows)
            else:
                cu = PackedSeqs.coerce(packed).cu_seqlens_padded
                rows = int(cu[-1]) if isinstance(cu, Tensor) and cu.numel() else 0
            if rows:
                local = " (this rank's rows)" if cp is not None else ""
                raise ValueError(f"hidden_states{local} has no rows but packed describes {rows} "
                                 "(cu_seqlens_padded[-1]): pass the rows it describes, or an empty pack")
        self.last_indexer_loss = None
        return hidden_states.clone()

    def compute_dtype(self) -> torch.dtype:
        """The dtype the layer's projections compute in (its input must have it)."""
        # a frozen FP8-held projection tags its compute dtype: its ``weight`` would be dequantized just to be read
        tag = getattr(self.q_a_proj, "dtype_tag", None)
        return (self.q_a_proj.weight if tag is None else tag).dtype

    def _check_input(self, hidden_states: Tensor) -> None:
        """Type, rank, hidden size and dtype of ``hidden_states`` (``ValueError`` saying what to change)."""
        cfg = self.config
        if not isinstance(hidden_states, Tensor):
            raise ValueError(f"hidden_states must be a tensor, got {type(hidden_states).__name__}")
        if not hidden_states.is_floating_point():
            raise ValueError(f"hidden_states must be floating point, got {hidden_states.dtype}")
        if hidden_states.dim() not in (2, 3):
            raise ValueError(f"hidden_states must be [B, S, D] or [T, D], got shape {tuple(hidden_states.shape)}")
        if hidden_states.shape[-1] != cfg.hidden_size:
            raise ValueError(
                f"hidden_states has hidden size {hidden_states.shape[-1]} but the config says {cfg.hidden_size}"
            )
        # the projections' dtype: the layer's matmuls (autocast or not) would fail on mixed dtypes deep inside
        weight = self.compute_dtype()
        if hidden_states.dtype != weight:
            raise ValueError(
                f"hidden_states is {hidden_states.dtype} but the layer's weights are {weight}: cast the input "
                f"(hidden_states.to({weight})) or the layer (layer.to({hidden_states.dtype}))"
            )

    def _flatten(self, hidden_states: Tensor, packed: Packed | None,
                 cp: Planner | None) -> tuple[Tensor, Packed, tuple | None]:
        """``[T, D]`` rows, their packed metadata (a planner coerces it) and the ``(B, S)`` to restore, if any."""
        self._check_input(hidden_states)
        if hidden_states.dim() == 2:
            if packed is None:
                packed = PackedSeqs.uniform(1, hidden_states.shape[0], hidden_states.device)
            return hidden_states, packed, None
        if packed is not None:
            raise ValueError("packed= is for [T, D] input; got [B, S, D] hidden_states")
        if cp is not None and self.config.capture_safe:
            raise ValueError("under cp= hidden_states must be this rank's packed rows [T / P, D]")
        b, s, _ = hidden_states.shape
        return hidden_states.reshape(b * s, -1), PackedSeqs.uniform(b, s, hidden_states.device), (b, s)
