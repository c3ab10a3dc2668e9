"""One attention layer under context parallelism: this rank's rows in, this rank's output rows out.

Steps (per layer), interleaved so each collective overlaps independent work:

1. launch the halo all-gather of the input tails; meanwhile project this rank's queries;
2. assemble ext rows (halo + own rows); compress the groups this rank owns (those whose last token it
   holds); launch the all-gather of [compressed KV | indexer keys]; meanwhile project raw KV for ext rows;
3. put the gathered entries in global order, run the same ``select`` and ``heads`` phases (query heads,
   sparse attention, indexer loss, output projection) as the single-process layer on the local rows, with
   global compressed ids and global positions. The indexer loss weights rows by ``1 / (global real rows)``,
   so the ranks' losses sum to the single-process loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..layers.attention import CompressedRange, IndexerLossInputs
from ..packing import PackedSeqs
from .gather import start_gather_rows
from .halo import finish_halo_exchange, start_halo_exchange
from .plan import build_plan, check_inputs

__all__ = ["cp_attention_forward"]


def cp_attention_forward(layer: Any, x_local: Tensor, packed_global: Any, cp: Any) -> Tensor:
    """Forward of ``layer`` (a :class:`csattn.HybridAttention`) on this rank's rows.

    Args:
        layer: the attention layer (its phase methods are reused unchanged).
        x_local: ``[T / P, D]`` this rank's rows of the global stream (``cp.shard(x, packed)``).
        packed_global: metadata of the whole ``T``-row stream (``PackedSeqs`` or ``PackedSeqParams``-like),
            identical on every rank.
        cp: a :class:`csattn.ContextParallel`.

    Returns:
        ``[T / P, D]`` this rank's output rows. Raises the same ``ValueError`` on every rank on bad input.
    """
    cfg = layer.config
    packed = PackedSeqs.coerce(packed_global)
    check_inputs(x_local, packed, cfg, cp)
    plan = build_plan(packed, cfg, cp, x_local.device)
    group = cp.group

    halo = start_halo_exchange(x_local, plan, group)
    cos, sin = layer.rope_tables(plan.pos_local, x_local.dtype)
    qr = layer.query_latent(x_local)  # overlaps the halo exchange
    x_ext = finish_halo_exchange(x_local, plan, halo)

    ckv = compressed_ids = loss = None
    pending = None
    if layer.compressor is not None and plan.num_entries > 0:
        meta = plan.local_meta
        backend = layer.backend_for(x_local)
        owned = layer.compressor.compress(x_ext, meta, layer.inv_freq, backend=backend)
        if cfg.layer_type == "csa":
            owned = torch.cat([owned, layer.index_keys(x_ext, meta).to(owned.dtype)], dim=1)
        if plan.max_owned > plan.num_owned:
            owned = torch.cat([owned, owned.new_zeros(plan.max_owned - plan.num_owned, owned.shape[1])])
        pending = start_gather_rows(owned, group)

    cos_e, sin_e = layer.rope_tables(plan.pos_ext, x_local.dtype)
    kv = layer.raw_kv(x_ext, cos_e, sin_e)  # overlaps the compressed-entry gather

    if layer.compressor is not None:
        if pending is not None:
            entries = pending.wait()[plan.gathered_order]  # [Nc, d (+ cI)] in global id order
            # contiguous copies (T / r rows): the fused kernels take dense row-major operands
            ckv = entries[:, : cfg.head_dim].contiguous()
            keys = entries[:, cfg.head_dim:].contiguous()
        else:  # no compressed entry anywhere in the stream (same decision on every rank)
            ckv = x_local.new_zeros(0, cfg.head_dim)
            keys = x_local.new_zeros(0, cfg.index_head_dim)
        if cfg.layer_type == "hca":
            # expanded one row chunk at a time inside attend: never [T/P, T/r] ids at once
            compressed_ids = CompressedRange(plan.vis_start, plan.vis_end, plan.max_visible)
        else:
            if pending is None:  # keep the indexer parameters in the graph, as the single-process layer does
                keys = layer.index_keys(x_ext, plan.local_meta)
            compressed_ids, (q_idx, w, k_idx) = layer.select(x_local, qr, cos, sin, keys, plan.vis_start,
                                                             plan.vis_end, plan.max_visible)  # global bound
            loss = IndexerLossInputs(q_idx, w, k_idx, plan.real_local, plan.num_real, plan.vis_start, plan.vis_end)
    return layer.heads(qr, cos, sin, kv, ckv, plan.window_ids, compressed_ids, loss)
