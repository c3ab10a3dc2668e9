"""Building blocks of the attention layer, named like Hugging Face's ``DeepseekV4Attention`` submodules so
state dicts map one to one."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..ops.backend import Backend
from ..ops.compressor import compress_pool
from ..ops.indexer_loss import StudentQueries
from ..ops.recompute import row_chunked
from ..ops.rms_norm import rms_norm
from ..ops.rope import apply_rope, rope_cos_sin
from ..packing import CompressMeta

__all__ = [
    "RowPieces", "map_rows", "RMSNorm", "rms_norm_unweighted", "GroupedLinear", "grouped_linear", "Compressor",
    "Indexer", "IndexerScorer", "indexer_queries", "LowRankTerm", "Projection", "linear", "grouped_augmented",
    "grouped_product",
]


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (fp64 for fp64 inputs), weight applied before casting back; its backward keeps
    only the input and one scale per row (:func:`csattn.ops.rms_norm.rms_norm`)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class RowPieces(NamedTuple):
    """Rows given as consecutive pieces that are never concatenated, e.g. a context-parallel rank's halo rows
    and its own rows. Row-wise maps (the input projections) run piece by piece and their outputs are
    concatenated, so what autograd saves are the pieces, views of existing tensors: a rank never copies its
    ``[T / P, D]`` input into a halo-extended one."""

    pieces: tuple[Tensor, ...]

    def map(self, fn: Callable[[Tensor], Tensor]) -> Tensor:
        """``fn(cat(pieces))`` for a row-wise ``fn``, computed as ``cat(fn(piece) ...)``."""
        return torch.cat([fn(p) for p in self.pieces], dim=0)

    def detach(self) -> RowPieces:
        return RowPieces(tuple(p.detach() for p in self.pieces))


def map_rows(fn: Callable[[Tensor], Tensor], x: Tensor | RowPieces) -> Tensor:
    """``fn(x)`` for a tensor, piece by piece for :class:`RowPieces` (``fn`` must be row-wise)."""
    return x.map(fn) if isinstance(x, RowPieces) else fn(x)


def rms_norm_unweighted(x: Tensor, eps: float) -> Tensor:
    """Per-head RMSNorm without weight (the query norm)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    return x * torch.rsqrt(x.to(compute).pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


class LowRankTerm(NamedTuple):
    """A low-rank term beside a weight ``W [out, in]``: ``x W^T + scale (x a^T) b^T`` (LoRA's pair: ``a [r, in]``,
    ``b [out, r]``). For a grouped weight ``[g out_g, in]`` (:func:`grouped_linear`) ``a`` is shared by the groups
    and ``b``'s rows follow ``W``'s (PEFT's pair on the 2-D weight)."""

    a: Tensor
    b: Tensor
    scale: float


class Projection(NamedTuple):
    """What a layer multiplies by where it reads a projection's weight instead of calling the module: the weight and
    an optional :class:`LowRankTerm`, which runs factored (a frozen ``W`` gets no gradient GEMM of its size; the
    term's own are rank-``r`` products)."""

    weight: Tensor
    term: LowRankTerm | None = None

    @property
    def scale(self) -> float:
        """The term's scale (0.0 without a term): what :meth:`of` takes back beside :meth:`tensors`."""
        return self.term.scale if self.term is not None else 0.0

    def tensors(self) -> tuple[Tensor, ...]:
        """``(W,)`` or ``(W, a, b)``: the tensors a recomputing op carries (see :meth:`of`)."""
        return (self.weight,) if self.term is None else (self.weight, self.term.a, self.term.b)

    @staticmethod
    def of(tensors: tuple[Tensor | None, ...], scale: float) -> Projection:
        """The projection of :meth:`tensors`' output (or ``(W, None, None)``: no term) and the term's ``scale``."""
        w, *ab = tensors
        return Projection(w, LowRankTerm(ab[0], ab[1], scale) if ab and ab[0] is not None else None)

    def merged(self) -> Tensor:
        """``W + scale b a`` in ``W``'s dtype, for the paths that carry one weight tensor (its gradient reaches
        ``a`` and ``b`` through a GEMM of ``W``'s size)."""
        if self.term is None:
            return self.weight
        a, b, scale = self.term
        return torch.addmm(self.weight, b.to(self.weight.dtype), a.to(self.weight.dtype), alpha=scale)


def linear(x: Tensor, p: Projection, bias: Tensor | None = None, term_input: Tensor | None = None) -> Tensor:
    """``x [..., in]`` -> ``[..., out]``: ``x W^T + bias`` plus the term on ``term_input`` (default ``x``; LoRA's
    dropout gives it another), which the GEMM adds (beta 1: no product, scaling and sum passes over the output)."""
    y = nn.functional.linear(x, p.weight, bias)
    if p.term is None:
        return y
    a, b, scale = p.term
    xa = nn.functional.linear(x if term_input is None else term_input, a)
    return torch.addmm(y.reshape(-1, y.shape[-1]), xa.reshape(-1, xa.shape[-1]), b.t(), alpha=scale).view(y.shape)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: ``g`` groups, each ``[out/g, in_per_group]`` (weight ``[out, in_per_group]``)."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__()
        if out_features % groups:
            raise ValueError(f"out_features ({out_features}) must be divisible by groups ({groups})")
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, g, in_per_group]`` -> ``[T, g * out/g]``."""
        return grouped_linear(x, self.weight, self.groups)


def grouped_linear(x: Tensor, weight: Tensor, groups: int, term: LowRankTerm | None = None) -> Tensor:
    """Block-diagonal projection of ``x [T, g, in]`` by ``weight [g * out, in]`` -> ``[T, g * out]``, plus the
    low-rank ``term`` (``a [r, in]`` shared by the groups, ``b [g * out, r]``)."""
    w = weight.view(groups, -1, weight.shape[-1])  # [g, out, in]
    # one batched GEMM over the groups on x's own strides (an einsum would first copy x group-major); without
    # autograd it writes the token-major output in place (no copy of the group-major product either)
    xt, wt = x.transpose(0, 1), w.transpose(1, 2)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, *(term[:2] if term else ())))):
        if term is not None:
            return grouped_product(x, weight, term, grouped_augmented(weight, groups, term))[0]
        out = x.new_empty(x.shape[0], groups, w.shape[1])
        torch.bmm(xt, wt, out=out.transpose(0, 1))
        return out.flatten(1)
    out = torch.bmm(xt, wt)  # [g, T, out]
    if term is not None:
        a, b, scale = term
        # each group's term added by its GEMM (beta 1)
        out = torch.baddbmm(out, nn.functional.linear(x, a).transpose(0, 1),
                            b.view(groups, -1, b.shape[-1]).transpose(1, 2), alpha=scale)
    return out.transpose(0, 1).flatten(1)


def grouped_augmented(weight: Tensor, groups: int, term: LowRankTerm) -> Tensor:
    """``[W_g ; a]`` per group (``[g, out + r, in]``) for :func:`grouped_product` (a copy of ``W``: made once where
    many row blocks take it)."""
    w_g = weight.view(groups, -1, weight.shape[-1])
    return torch.cat([w_g, term.a.to(w_g.dtype).expand(groups, -1, -1)], 1)


def grouped_product(x: Tensor, weight: Tensor, term: LowRankTerm, w_aug: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`grouped_linear` with a term, without autograd: ``(z [T, g out], x a^T [T, g, r])`` from one batched GEMM
    over ``x [T, g, in]`` and ``w_aug`` = ``[W_g ; a]`` (:func:`grouped_augmented`), so ``x`` is read once (the
    attention's ``o_a_proj`` input is ``H d`` wide, the layer's widest); each group's ``scale (x_g a^T) b_g^T`` is
    then added by its GEMM (beta 1)."""
    groups, o = x.shape[1], weight.shape[0] // x.shape[1]
    both = x.new_empty(x.shape[0], groups, w_aug.shape[1])  # [T, g, out + r], written through its [g, T, .] view
    torch.bmm(x.transpose(0, 1), w_aug.transpose(1, 2), out=both.transpose(0, 1))
    z, xa = both[..., :o], both[..., o:]
    z.transpose(0, 1).baddbmm_(xa.transpose(0, 1), term.b.view(groups, o, -1).transpose(1, 2), alpha=term.scale)
    return z.reshape(x.shape[0], groups * o), xa


def _linear(dim_in: int, dim_out: int) -> nn.Linear:
    layer = nn.Linear(dim_in, dim_out, bias=False)
    nn.init.normal_(layer.weight, std=0.02)
    return layer


class Compressor(nn.Module):
    """Gated pooling of ``ratio``-token blocks into entries, then RMSNorm and RoPE at position ``i * ratio``.

    With ``overlap`` (CSA) projections are ``2c`` wide and entry i pools block i-1's first half and block
    i's second half.
    """

    def __init__(self, hidden_size: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        coff = 2 if overlap else 1
        self.ratio, self.overlap, self.dim = ratio, overlap, dim
        self.kv_proj = _linear(hidden_size, coff * dim)
        self.gate_proj = _linear(hidden_size, coff * dim)
        self.position_bias = nn.Parameter(torch.zeros(ratio, coff * dim))
        self.kv_norm = RMSNorm(dim, eps)

    def compress(self, x: Tensor | RowPieces, meta: CompressMeta, inv_freq: Tensor,
                 backend: Backend = "reference") -> Tensor:
        """Entries ``[Nc, dim]`` from rows ``x [T, D]`` (``meta.entry_row`` indexes ``x``'s rows: under context
        parallelism the plan gives them in the rank's halo-extended rows)."""
        kv = map_rows(self.kv_proj, x)
        gate = map_rows(self.gate_proj, x)
        pooled = compress_pool(kv, gate, self.position_bias, meta.entry_row, meta.entry_first, self.ratio,
                               self.overlap, backend=backend)
        return self.finish(pooled, meta.entry_pos, inv_freq)

    def finish(self, pooled: Tensor, entry_pos: Tensor, inv_freq: Tensor) -> Tensor:
        """RMSNorm then RoPE at each entry's first-token position."""
        normed = self.kv_norm(pooled)
        if inv_freq.numel() == 0:
            return normed
        cos, sin = rope_cos_sin(entry_pos, inv_freq, torch.promote_types(normed.dtype, torch.float32))
        return apply_rope(normed, cos, sin)


class IndexerScorer(nn.Module):
    """Per-head weights of the lightning indexer, scaled by ``cI^-0.5 * HI^-0.5``."""

    def __init__(self, hidden_size: int, n_heads: int, head_dim: int) -> None:
        super().__init__()
        self.weights_proj = _linear(hidden_size, n_heads)
        self.scale = head_dim ** -0.5 * n_heads ** -0.5

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, D]`` -> ``[T, HI]`` in fp32 (fp64 for fp64 inputs)."""
        compute = torch.promote_types(x.dtype, torch.float32)
        return self.weights_proj(x).to(compute) * self.scale


class Indexer(Compressor):
    """Lightning indexer: its own overlapping compressor for keys, queries from the shared latent ``qr``."""

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, ratio: int,
                 eps: float) -> None:
        super().__init__(hidden_size, head_dim, ratio, overlap=True, eps=eps)
        self.n_heads, self.head_dim = n_heads, head_dim
        self.q_b_proj = _linear(q_lora_rank, n_heads * head_dim)
        self.scorer = IndexerScorer(hidden_size, n_heads, head_dim)

    def queries(self, qr: Tensor, cos: Tensor, sin: Tensor, chunk_rows: int | None = None,
                backend: Backend = "reference", q_b: Projection | None = None) -> Tensor:
        """``qr [T, q_lora]`` -> ``[T, HI, cI]`` with RoPE at each row's position (one Triton pass on
        ``backend="triton"``).

        With ``chunk_rows`` the rows are computed ``chunk_rows`` at a time into the output and recomputed that
        way in the backward (``row_chunked``): the projection's output and the fp32 RoPE temporaries, about
        4.5x the size of the queries when made for all rows at once (9 GiB at 128k tokens for HI = 64,
        cI = 128), never exceed one chunk. ``q_b`` replaces ``q_b_proj.weight`` (the layer passes its projection,
        with LoRA's term where it has one, run factored: see ``HybridAttention.projection``).
        """
        q_b = q_b or Projection(self.q_b_proj.weight)
        fn = self._query_fn(backend, q_b)
        if chunk_rows is None or qr.shape[0] <= chunk_rows or torch.compiler.is_compiling():
            return fn(qr, cos, sin, *q_b.tensors())
        return row_chunked(fn, (qr, cos, sin), q_b.tensors(), chunk_rows)

    def student_queries(self, qr: Tensor, cos: Tensor, sin: Tensor, chunk_rows: int,
                        backend: Backend = "reference", q_b: Projection | None = None) -> StudentQueries:
        """The same queries as a recipe for the sparse indexer loss, which recomputes them ``chunk_rows`` at a
        time in its backward instead of keeping them (``q_b`` as in :meth:`queries`)."""
        q_b = q_b or Projection(self.q_b_proj.weight)
        return StudentQueries(self._query_fn(backend, q_b), qr, cos, sin, q_b.tensors(), chunk_rows)

    def _query_fn(self, backend: Backend, q_b: Projection) -> Callable[..., Tensor]:
        """``fn(qr, cos, sin, *q_b.tensors())``: the queries from the projection's tensors."""
        return partial(_indexer_queries_of, heads=self.n_heads, backend=backend, scale=q_b.scale)


def _indexer_queries_of(qr: Tensor, cos: Tensor, sin: Tensor, *tensors: Tensor, heads: int, backend: Backend,
                        scale: float) -> Tensor:
    return indexer_queries(qr, cos, sin, Projection.of(tensors, scale), heads, backend)


def indexer_queries(qr: Tensor, cos: Tensor, sin: Tensor, q_b: Projection, heads: int,
                    backend: Backend = "reference") -> Tensor:
    """The lightning indexer's queries: ``qr [T, q_lora]`` -> ``[T, HI, cI]`` (``q_b_proj``, weight ``[HI cI,
    q_lora]`` with its low-rank term, then RoPE at each row's position; on ``backend="triton"`` in one Triton pass,
    as the query heads')."""
    q = linear(qr, q_b).unflatten(-1, (heads, -1))
    if not cos.numel():
        return q
    if backend == "triton":
        from ..ops.rope.triton import rope_heads_triton  # lazy: importing csattn must not need Triton

        return rope_heads_triton(q, cos, sin)
    return apply_rope(q, cos, sin)
