"""``HybridAttention``: one DeepSeek-V4 attention layer (sliding window, CSA or HCA) on packed sequences."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..config import AttentionConfig
from ..ops.indexer import indexer_topk
from ..ops.indexer_loss import (
    SparseTeacher,
    attach_indexer_loss,
    indexer_kl_from_teacher,
    indexer_kl_loss,
    sparse_teacher_block,
)
from ..ops.indices import combine_indices, range_indices, window_indices
from ..ops.recompute import row_chunked
from ..ops.rope import apply_rope, rope_cos_sin, rope_inv_freq
from ..ops.sparse_attn import sparse_attn
from ..packing import CompressMeta, PackedSeqs
from .core import BlockIds, CoreGeometry, attention_core, output_projection, query_heads
from .modules import Compressor, GroupedLinear, Indexer, RMSNorm, RowPieces, _linear, map_rows

__all__ = ["HybridAttention", "CompressedRange", "IndexerLossInputs"]


class CompressedRange(NamedTuple):
    """Every compressed id in ``[start[t], end[t])`` for row t; ``width`` bounds ``end - start``."""

    start: Tensor
    end: Tensor
    width: int


class IndexerLossInputs(NamedTuple):
    """What the indexer KL loss needs besides the attention: the indexer's queries, weights and keys, which
    rows are real (``num_real`` over the whole stream, global under context parallelism) and the visible
    compressed-id ranges (for the dense loss)."""

    q_idx: Tensor
    w: Tensor
    k_idx: Tensor
    real: Tensor
    num_real: int | Tensor  # a host int, or a device scalar on the capture-safe path
    vis_start: Tensor
    vis_end: Tensor

    def row_weight(self, dtype: torch.dtype) -> Tensor:
        """``1 / num_real`` for real rows, 0 for padding (divided on the device for a device count)."""
        if isinstance(self.num_real, Tensor):
            return self.real.to(dtype) / self.num_real.clamp(min=1)
        return self.real.to(dtype) / max(self.num_real, 1)


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
    def forward(self, hidden_states: Tensor, packed: Any = None, cp: Any = None) -> Tensor:
        """Args:
            hidden_states: ``[B, S, D]`` or packed ``[T, D]`` (the normalized block input).
            packed: packed metadata for ``[T, D]`` input (None = one document). Under ``cp`` it describes
                the global stream and ``hidden_states`` holds this rank's rows.
            cp: optional ``csattn.ContextParallel``.

        Returns:
            ``[B, S, D]`` or ``[T, D]``, like the input. Input without rows (``T = 0``, ``B = 0`` or ``S = 0``:
            an empty pack) gives an output without rows.
        """
        if isinstance(hidden_states, Tensor) and hidden_states.dim() in (2, 3) and not hidden_states.shape[:-1].numel():
            return self._empty_forward(hidden_states, packed, cp)
        if self.config.capture_safe or getattr(packed, "capture_safe", False):
            from ..graphs import capture_safe_forward  # local import: the graphs package depends on this module

            return capture_safe_forward(self, hidden_states, packed, cp)
        x, packed, batch_shape = self._flatten(hidden_states, packed)
        if cp is not None:
            from ..cp import cp_attention_forward  # local import: the CP package depends on this module

            out = cp_attention_forward(self, x, packed, cp)
        else:
            packed.validate(x.shape[0], x.device)
            out = self.forward_packed(x, packed)
        return out.view(*batch_shape, -1) if batch_shape is not None else out

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

    # ------------------------------------------------------------------ phases (shared with the CP path)
    def rope_tables(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(pos, self.inv_freq, torch.promote_types(dtype, torch.float32))

    def query_latent(self, x: Tensor) -> Tensor:
        """The shared query latent ``qr [T, q_lora]`` (``q_a_proj`` then RMSNorm)."""
        return self.q_a_norm(self.q_a_proj(x))

    def queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """``q [T, H, d]`` (normed, roped) and the shared latent ``qr [T, q_lora]``."""
        qr = self.query_latent(x)
        return self.query_heads(qr, cos, sin), qr

    def query_heads(self, qr: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``q [T, H, d]`` from the latent; block-recomputed in the backward with ``recompute_projections``."""
        cfg = self.config
        if not cfg.recompute_projections:
            return query_heads(qr, cos, sin, self.q_b_proj.weight, cfg.num_heads, cfg.rms_norm_eps)
        fn = partial(query_heads, heads=cfg.num_heads, eps=cfg.rms_norm_eps)
        return row_chunked(fn, (qr, cos, sin), (self.q_b_proj.weight,), self.recompute_rows())

    def raw_kv(self, x: Tensor | RowPieces, cos: Tensor, sin: Tensor) -> Tensor:
        """The single K = V head of every row, ``[T, d]``."""
        return apply_rope(self.kv_norm(map_rows(self.kv_proj, x)), cos, sin)

    def output(self, o: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Inverse RoPE on ``o [T, H, d]`` (values carried absolute rope), then the grouped projection."""
        cfg = self.config
        weights = (self.o_a_proj.weight, self.o_b_proj.weight)
        if not cfg.recompute_projections:
            return output_projection(o, cos, sin, *weights, groups=cfg.o_groups)
        fn = partial(output_projection, groups=cfg.o_groups)
        return row_chunked(fn, (o, cos, sin), weights, self.recompute_rows())

    def recompute_rows(self) -> int:
        """Rows per recomputed block: about a quarter of the workspace for ~4 fp32 ``[H, d]`` temporaries."""
        cfg = self.config
        return max(16, (cfg.workspace_bytes // 4) // (cfg.num_heads * cfg.head_dim * 16))

    def attend(
        self,
        q: Tensor,
        kv: Tensor,
        ckv: Tensor | None,
        window_ids: Tensor,
        compressed_ids: Tensor | CompressedRange | None,
        run: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Sparse attention of ``q`` over window keys (rows of ``kv``) and compressed keys (rows of ``ckv``).

        ``compressed_ids`` is a ``[T, k]`` id matrix (CSA top-k) or a :class:`CompressedRange` (HCA: every
        visible entry). A range is expanded to ids one row chunk at a time, so the index lists never take
        ``T * T / r`` memory. ``run(q, keys, ids)`` replaces the sparse-attention call (the capture-safe path
        passes its custom op).
        """
        cfg = self.config
        if run is None:
            backend = self.backend_for(q)

            def run(q_: Tensor, keys: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
                return sparse_attn(q_, keys, ids, self.sinks, cfg.scale, chunk_rows=cfg.attn_chunk_rows,
                                   backend=backend, config=cfg.sparse_attn_kernel)

        keys, ids_fn = self.key_ids(kv, ckv, window_ids, compressed_ids)
        total = q.shape[0]
        if not isinstance(compressed_ids, CompressedRange):
            return run(q, keys, ids_fn(0, total))
        step = max(1, (cfg.workspace_bytes // 8) // (window_ids.shape[1] + max(compressed_ids.width, 1)))
        if step >= total:
            return run(q, keys, ids_fn(0, total))
        parts = [run(q[lo:lo + step], keys, ids_fn(lo, min(lo + step, total))) for lo in range(0, total, step)]
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])

    def backend_for(self, t: Tensor | RowPieces) -> str:
        """``"triton"`` on CUDA by default (``backend="auto"``), the reference elsewhere."""
        backend = self.config.backend
        if backend == "auto":
            device = t.pieces[-1].device if isinstance(t, RowPieces) else t.device
            return "triton" if device.type == "cuda" else "reference"
        return backend

    def indexer_query_rows(self) -> int:
        """Rows per chunk of the indexer queries: their projection and fp32 RoPE temporaries (~16 bytes per
        channel) within the workspace."""
        cfg = self.config
        return max(64, cfg.workspace_bytes // (16 * cfg.index_n_heads * cfg.index_head_dim))

    def wants_indexer_loss(self) -> bool:
        return (
            self.config.layer_type == "csa"
            and self.config.compute_indexer_loss
            and torch.is_grad_enabled()
        )

    # ------------------------------------------------------------------ single-process forward
    def forward_packed(self, x: Tensor, packed: PackedSeqs) -> Tensor:
        """Forward over a whole packed stream ``x [T, D]`` (no context parallelism)."""
        cfg = self.config
        rows = packed.rows(x.device)
        cos, sin = self.rope_tables(rows.pos, x.dtype)
        qr = self.query_latent(x)
        kv = self.raw_kv(x, cos, sin)
        window_ids = window_indices(rows.pos, rows.real, cfg.sliding_window)

        ckv = compressed_ids = loss = None
        if self.compressor is not None:
            meta = packed.compress(cfg.compress_ratio, x.device)
            ckv = self.compressor.compress(x, meta, self.inv_freq, backend=self.backend_for(x))
            if cfg.layer_type == "hca":
                compressed_ids = CompressedRange(meta.vis_start, meta.vis_end, meta.max_visible)
            else:
                keys = self.index_keys(x, meta)
                compressed_ids, (q_idx, w, k_idx) = self.select(x, qr, cos, sin, keys, meta.vis_start, meta.vis_end,
                                                                meta.max_visible)
                loss = IndexerLossInputs(q_idx, w, k_idx, rows.real, rows.num_real, meta.vis_start, meta.vis_end)
        return self.heads(qr, cos, sin, kv, ckv, window_ids, compressed_ids, loss)

    def heads(
        self,
        qr: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv: Tensor,
        ckv: Tensor | None,
        window_ids: Tensor,
        compressed_ids: Tensor | CompressedRange | None,
        loss: IndexerLossInputs | None,
        loss_scale: float | None = None,
    ) -> Tensor:
        """Everything per head, from the query latent to the layer output ``[T, D]``: query heads, sparse
        attention over window + compressed keys, the indexer loss (attached to the output) and the output
        projection.

        With ``recompute_projections`` (the default) this runs block by block in :func:`attention_core`, and
        no ``[T, H, d]`` tensor is ever whole; the dense indexer loss needs all queries at once, so it takes
        the unblocked path (queries and output projection still recomputed block by block). ``loss_scale``
        fixes the indexer loss's gradient scale (captured graphs); None reads the global one in the backward.
        Nothing here reads device values on the host, so it is also the capture-safe path's core.
        """
        cfg = self.config
        self.last_indexer_loss = None
        want_loss = loss is not None and ckv is not None and self.wants_indexer_loss()
        if not cfg.recompute_projections or (want_loss and cfg.indexer_loss_type == "dense"):
            q = self.query_heads(qr, cos, sin)
            o, lse = self.attend(q, kv, ckv, window_ids, compressed_ids)
            if want_loss:
                o = self.with_indexer_loss(o, loss, q, ckv, lse, compressed_ids, loss_scale)
            return self.output(o, cos, sin)

        keys, ids_fn = self.key_ids(kv, ckv, window_ids, compressed_ids)
        backend = self.backend_for(qr)
        geo = CoreGeometry(heads=cfg.num_heads, groups=cfg.o_groups, eps=cfg.rms_norm_eps, scale=cfg.scale,
                           block_rows=self.core_block_rows(window_ids, compressed_ids), backend=backend,
                           ref_chunk_rows=cfg.attn_chunk_rows, sparse_attn=cfg.sparse_attn_kernel)
        on_block = teacher = None
        if want_loss:
            row_weight = loss.row_weight(torch.promote_types(qr.dtype, torch.float32))
            teacher = SparseTeacher(qr.shape[0], compressed_ids.shape[1], row_weight.dtype, qr.device,
                                    fused=backend == "triton")

            def on_block(lo: int, hi: int, q: Tensor, lse: Tensor) -> None:
                sparse_teacher_block(teacher, lo, loss.q_idx[lo:hi], loss.w[lo:hi], loss.k_idx, q, ckv, lse,
                                     cfg.scale, row_weight[lo:hi], compressed_ids[lo:hi], backend=backend)

        weights = (self.q_b_proj.weight, self.o_a_proj.weight, self.o_b_proj.weight)
        out = attention_core(qr, cos, sin, keys, self.sinks, *weights, ids_fn, geo, on_block)
        if teacher is not None:
            # the backward recomputes the indexer queries block by block instead of keeping q_idx [T, HI, cI]
            queries = self.compressor.indexer.student_queries(qr.detach(), cos, sin, self.indexer_query_rows())
            kl = indexer_kl_from_teacher(queries, loss.w, loss.k_idx, teacher, row_weight, compressed_ids,
                                         workspace_bytes=cfg.workspace_bytes, backend=backend)
            self.last_indexer_loss = kl.detach()
            out = attach_indexer_loss(out, kl * cfg.indexer_loss_coeff, loss_scale)
        return out

    def key_ids(
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

    def core_block_rows(self, window_ids: Tensor, compressed_ids: Tensor | CompressedRange | None) -> int:
        """Rows per block of the fused core: its per-head temporaries (``q``, ``o``, ``do``, ``dq``, the
        projection outputs around them and, on the reference backend, fp32 RMSNorm / RoPE temporaries: about
        16 bytes per head channel with the Triton kernels, 24 without) and the block's int64 ids within the
        workspace."""
        cfg = self.config
        per_channel = 16 if self.backend_for(window_ids) == "triton" else 24
        width = window_ids.shape[1]
        if isinstance(compressed_ids, CompressedRange):
            width += compressed_ids.width
        elif compressed_ids is not None:
            width += compressed_ids.shape[1]
        per_row = cfg.num_heads * cfg.head_dim * per_channel + width * 8
        rows = max(16, cfg.workspace_bytes // per_row)
        return rows if rows < 256 else rows // 128 * 128  # whole waves of row programs on the GPU

    def index_keys(self, x: Tensor | RowPieces, meta: CompressMeta, row_offset: int = 0) -> Tensor:
        """The indexer's own compressed keys ``[Nc, cI]`` from detached ``x`` (CSA)."""
        return self.compressor.indexer.compress(x.detach(), meta, self.inv_freq, row_offset=row_offset,
                                               backend=self.backend_for(x))

    def effective_topk(self, max_visible: int) -> int:
        """Width of the top-k lists: ``index_topk`` capped by the most entries any row can see (HF's
        ``min(index_topk, compressed_len)``). Columns past that are -1 on every row, so dropping them changes
        no result, while keeping them would make every per-row tensor (ids, gathered keys, teacher masses)
        grow with ``index_topk`` itself. ``max_visible`` is a host int: the widest visible range of the pack,
        or its static bound on the capture-safe path. At least 1 (the top-k needs a column)."""
        return max(1, min(self.config.index_topk, int(max_visible)))

    def select(
        self,
        x: Tensor,
        qr: Tensor,
        cos: Tensor,
        sin: Tensor,
        index_keys: Tensor,
        vis_start: Tensor,
        vis_end: Tensor,
        max_visible: int | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        """Lightning-indexer top-k for the rows of ``x`` / ``qr`` (CSA).

        The indexer sees detached inputs: the language-model loss sends it no gradient; only the
        indexer loss trains it. ``max_visible`` (the widest ``vis_end - vis_start``) caps the list width; None
        = ``index_topk`` uncapped.

        Returns:
            ``selected [T, k]`` global compressed ids (-1 = none) and ``(q_idx, w, k_idx)`` for the loss.
        """
        cfg = self.config
        indexer: Indexer = self.compressor.indexer
        q_idx = indexer.queries(qr.detach(), cos, sin, chunk_rows=self.indexer_query_rows())
        w = indexer.scorer(x.detach())
        topk = cfg.index_topk if max_visible is None else self.effective_topk(max_visible)
        selected = indexer_topk(q_idx, w, index_keys, vis_start, vis_end, topk,
                                workspace_bytes=cfg.workspace_bytes, backend=self.backend_for(q_idx))
        return selected, (q_idx, w, index_keys)

    def with_indexer_loss(self, o: Tensor, loss: IndexerLossInputs, q: Tensor, ckv: Tensor, lse: Tensor,
                          selected: Tensor, loss_scale: float | None = None) -> Tensor:
        """Attach ``coeff * sum_t KL_t / num_real`` over the real rows to ``o`` (its gradient flows in ``o``'s
        backward) and log the KL in ``last_indexer_loss``.

        ``loss.num_real`` is the number of real rows of the whole stream (global under context parallelism, so
        the ranks' losses sum to the single-process loss).
        """
        cfg = self.config
        kl = indexer_kl_loss(
            loss.q_idx, loss.w, loss.k_idx, q, ckv, lse, cfg.scale, loss.row_weight(lse.dtype),
            selected=selected if cfg.indexer_loss_type == "sparse" else None,
            vis_start=loss.vis_start, vis_end=loss.vis_end, workspace_bytes=cfg.workspace_bytes,
            backend=self.backend_for(loss.q_idx),
        )
        self.last_indexer_loss = kl.detach()
        return attach_indexer_loss(o, kl * cfg.indexer_loss_coeff, loss_scale)

    # ------------------------------------------------------------------ input handling
    def _empty_forward(self, hidden_states: Tensor, packed: Any, cp: Any) -> Tensor:
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
        weight = self.q_a_proj.weight.dtype
        if hidden_states.dtype != weight:
            raise ValueError(
                f"hidden_states is {hidden_states.dtype} but the layer's weights are {weight}: cast the input "
                f"(hidden_states.to({weight})) or the layer (layer.to({hidden_states.dtype}))"
            )

    def _flatten(self, hidden_states: Tensor, packed: Any) -> tuple[Tensor, PackedSeqs, tuple | None]:
        self._check_input(hidden_states)
        if hidden_states.dim() == 3:
            if packed is not None:
                raise ValueError("packed= is for [T, D] input; got [B, S, D] hidden_states")
            b, s, _ = hidden_states.shape
            return hidden_states.reshape(b * s, -1), PackedSeqs.uniform(b, s, hidden_states.device), (b, s)
        if hidden_states.dim() != 2:
            raise ValueError(f"hidden_states must be [B, S, D] or [T, D], got shape {tuple(hidden_states.shape)}")
        if packed is None:
            packed = PackedSeqs.uniform(1, hidden_states.shape[0], hidden_states.device)
        return hidden_states, PackedSeqs.coerce(packed), None
