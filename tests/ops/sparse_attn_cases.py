"""Cases shared by the sparse-attention tests (the Triton kernels', the Gluon kernels'): layer-shaped index
lists, the gradients of a run, the same-dtype PyTorch yardstick."""

from __future__ import annotations

import torch


def packed_indices(doc_lens: list[int], window: int, topk: int, ratio: int, pad_rows: int,
                   gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Index lists shaped like the layer's: ``[window keys | selected compressed keys]`` per row, -1 padded.

    Rows of ``kv`` are the raw rows (``T`` of them, padding rows last) then each document's compressed
    entries (entry ``e`` of a document closes at position ``ratio*e + ratio-1``). The selection is random
    among the visible entries (stands in for the indexer's top-k). Returns ``(indices [T, W+k], N)``.
    """
    T = sum(doc_lens) + pad_rows
    rows, comp_base, n_comp = [], sum(doc_lens) + pad_rows, 0
    start = 0
    for L in doc_lens:
        pos = torch.arange(L)
        win = start + pos[:, None] - torch.arange(window - 1, -1, -1)[None, :]
        win = torch.where(win >= start, win, -1)
        ne = L // ratio
        visible = (pos + 1) // ratio  # entries e < visible[p] are complete at position p
        if topk > 0:
            score = torch.rand(L, max(ne, 1), generator=gen)
            score = score.masked_fill(torch.arange(max(ne, 1))[None, :] >= visible[:, None], -1.0)
            k_eff = min(topk, max(ne, 1))
            val, sel = score.topk(k_eff, dim=1)
            sel = torch.where(val >= 0, sel + comp_base + n_comp, -1)
            sel = torch.cat([sel, sel.new_full((L, topk - k_eff), -1)], dim=1)
            win = torch.cat([win, sel], dim=1)
        rows.append(win)
        n_comp += ne
        start += L
    rows.append(torch.full((pad_rows, window + topk), -1, dtype=torch.int64))
    return torch.cat(rows), T + n_comp


def grads_of(fn, q, kv, sink, do, dlse):
    """Run ``fn`` on fresh leaves; return ``[o, lse, dq, dkv, dsink]``."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, kv, sink)]
    o, lse = fn(*leaves)
    torch.autograd.backward([o, lse], [do.to(o.dtype), dlse.to(lse.dtype)])
    return [o, lse] + [x.grad for x in leaves]


NAMES = ["o", "lse", "dq", "dkv", "dsink"]


def lowp_attn(q, kv, idx, sink, scale):
    """Same-dtype PyTorch computation (products in q's dtype, softmax in fp32): the error yardstick."""
    valid = idx >= 0
    keys = kv[idx.clamp(min=0)]
    s = torch.einsum("thd,tkd->thk", q, keys).float() * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(torch.cat([s, sink[None, :, None].expand(s.shape[0], -1, 1)], -1), -1)
    p = torch.exp(s - lse[..., None]).to(q.dtype)
    return torch.einsum("thk,tkd->thd", p, keys), lse


def launch_reference_grads(q, kv, idx, topk_len, sink, do, dlse, scale, HAS_LEN, HAS_DLSE):
    """fp64 ``(dq, dkv, dsink)`` of the reference for a backward kernel's launch arguments (``topk_len`` read where
    ``HAS_LEN``, ``dlse`` where ``HAS_DLSE``): the math of the stand-ins that replace a kernel on a CPU."""
    if HAS_LEN:
        idx = torch.where(torch.arange(idx.shape[1])[None, :] < topk_len[:, None], idx, -1)
    from csattn.ops.sparse_attn import sparse_attn_ref

    leaves = [t.detach().double().requires_grad_() for t in (q, kv, sink)]
    with torch.enable_grad():
        o_ref, lse_ref = sparse_attn_ref(*leaves[:2], idx.long(), leaves[2], scale)
        return torch.autograd.grad((o_ref, lse_ref), leaves,
                                   (do.double(), dlse.double() if HAS_DLSE else torch.zeros_like(lse_ref)))
