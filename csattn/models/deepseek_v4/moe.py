"""DeepSeek-V4 mixture of experts: sqrt-softplus router with a load-balancing correction bias (or a frozen
token-id -> expert table on the first "hash" layers), routed experts with clamped SwiGLU, and one shared
expert. Names equal Hugging Face's ``DeepseekV4SparseMoeBlock`` (``gate``, ``experts``, ``shared_experts``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from csattn.layers.modules import Projection
from csattn.ops.autograd import with_zero_grads
from csattn.ops.backend import BackendChoice
from csattn.ops.moe import ExpertLora, clamped_swiglu, expert_load, moe_experts, route_plan

from .expert_parallel import ExpertParallel, all_to_all_rows, exchange_counts

__all__ = ["Router", "Experts", "SharedExpert", "MoE", "clamped_swiglu", "score_fn"]


def score_fn(logits: Tensor, kind: str) -> Tensor:
    """Router affinities from logits: ``sqrt(softplus(.))`` (V4), ``sigmoid`` or ``softmax``."""
    if kind == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if kind == "sigmoid":
        return torch.sigmoid(logits)
    if kind == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unknown scoring_func {kind!r}")


class Router(nn.Module):
    """Chooses ``k`` experts per token and their weights.

    Learned routing: ``topk(score + e_score_correction_bias)``; the bias only moves the choice (it is
    updated outside autograd to balance load, see :meth:`update_bias`). Hash routing: the choice is
    ``tid2eid[input_ids]``. Either way the weights are the unbiased scores of the chosen experts,
    normalized to sum 1, times ``routed_scaling_factor``.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, vocab_size: int, hashed: bool,
                 scoring_func: str, routed_scaling_factor: float) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.hashed = num_experts, top_k, hashed
        self.scoring_func, self.routed_scaling_factor = scoring_func, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def forward(self, x: Tensor, input_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``x [T, D]`` (and ``input_ids [T]`` on hash layers) -> ``weights [T, k]``, ``experts [T, k]`` int64."""
        scores = score_fn(F.linear(x, self.weight), self.scoring_func)
        if self.hashed:
            if input_ids is None:
                raise ValueError("input_ids is required by a hash-routed MoE layer")
            experts = self.tid2eid[input_ids.reshape(-1)].long()
        else:
            biased = scores + self.e_score_correction_bias.to(scores.dtype)
            experts = torch.topk(biased.detach(), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts

    @torch.no_grad()
    def init_hash_table(self, generator: torch.Generator) -> None:
        """``k`` distinct random experts per token id (checkpoints ship the real table)."""
        if self.hashed:
            vocab = self.tid2eid.shape[0]
            rand = torch.rand(vocab, self.num_experts, generator=generator)
            self.tid2eid.copy_(rand.argsort(dim=-1)[:, : self.top_k])

    @torch.no_grad()
    def update_bias(self, load: Tensor, rate: float) -> None:
        """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower overloaded ones.

        Args:
            load: ``[E]`` tokens routed to each expert (summed over every rank).
        """
        if self.hashed or rate == 0:
            return
        load = load.to(self.e_score_correction_bias.dtype)
        self.e_score_correction_bias.add_(rate * torch.sign(load.mean() - load))


class Experts(nn.Module):
    """Routed experts stored as 3-D tensors: ``gate_up_proj [E, 2I, D]`` (gate rows first), ``down_proj [E, D, I]``.

    ``backend`` picks the path of :func:`csattn.ops.moe.moe_experts`: ``"auto"`` (grouped GEMMs, Triton
    SwiGLU on CUDA), ``"reference"`` (the per-expert loop), ``"grouped"`` or ``"triton"``.

    ``local``: the global ids of the experts this module holds (an expert-parallel rank's share; default all
    ``num_experts``); the tensors then hold ``len(local)`` experts and take local ids. Each expert is drawn from
    its own generator (seeded from one draw of the global RNG plus its id), so an expert's initial weights do not
    depend on which rank holds it.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float,
                 backend: BackendChoice = "auto", local: range | None = None) -> None:
        super().__init__()
        self.local = range(num_experts) if local is None else local
        self.num_experts, self.limit, self.backend = num_experts, limit, backend
        n = len(self.local)
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(n, hidden_size, intermediate_size))
        self.init_seed = int(torch.randint(0, 2**62, (1,), device="cpu"))
        if not self.gate_up_proj.is_meta:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``normal(0, 0.02)`` per expert from its own generator (see the class docstring)."""
        for i, e in enumerate(self.local):
            gen = torch.Generator().manual_seed(self.init_seed + e)
            for w in (self.gate_up_proj[i], self.down_proj[i]):
                w.copy_(torch.empty(w.shape, dtype=w.dtype).normal_(0.0, 0.02, generator=gen))

    @torch.no_grad()
    def subset(self, local: range) -> Experts:
        """These experts' ``local`` share (global ids) as new experts on the same device and dtype (an
        expert-parallel rank's; fresh meta tensors on the meta device)."""
        with torch.device(self.gate_up_proj.device):
            new = Experts(self.num_experts, self.down_proj.shape[1], self.down_proj.shape[2], self.limit,
                          self.backend, local=local)
        new.init_seed = self.init_seed
        new.to(self.gate_up_proj.dtype)
        lo, hi = local.start - self.local.start, local.stop - self.local.start
        if not self.gate_up_proj.is_meta:
            new.gate_up_proj.copy_(self.gate_up_proj[lo:hi])
            new.down_proj.copy_(self.down_proj[lo:hi])
        return new

    def moe_operands(self) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """``(gate_up_proj, down_proj, keywords)``: the weights :func:`csattn.ops.moe.moe_experts` multiplies by and
        its keyword arguments for them (an FP8-held subclass adds its block scales and compute mode), so a module
        that adds terms of its own (LoRA) runs the same weights whatever holds them."""
        return self.gate_up_proj, self.down_proj, {}

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """``x [T, D]``, ``experts [T, k]`` (local ids), ``weights [T, k]`` -> ``[T, D]`` (weighted sum over the
        k picks)."""
        gate_up, down, held = self.moe_operands()
        return moe_experts(x, experts, weights, gate_up, down, self.limit, self.backend, **held)


class SharedExpert(nn.Module):
    """The always-on expert (clamped SwiGLU, ``moe_intermediate_size`` wide).

    It runs as the routed experts do (:func:`csattn.ops.moe.moe_experts` with one expert that every token picks
    at weight 1): the fused SwiGLU keeps only the gate / up product for the backward and recomputes the
    activation, where three ``nn.Linear`` calls and an eager SwiGLU keep about five ``[T, I]`` tensors.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float, backend: BackendChoice = "auto") -> None:
        super().__init__()
        self.limit, self.backend = limit, backend
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, std=0.02)

    def projection(self, name: str) -> Projection:
        """What the expert multiplies by for ``name`` (``gate_proj``, ``up_proj``, ``down_proj``), which it reads
        instead of calling the linear: the weight; a subclass may add a low-rank term (LoRA's pair, run factored
        through the grouped GEMMs) or return an effective weight."""
        return Projection(self.get_submodule(name).weight)

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, D]`` -> ``[T, D]``."""
        gate, up, down = (self.projection(n) for n in ("gate_proj", "up_proj", "down_proj"))
        # [1, 2I, D] gate rows first and [1, D, I]: the routed experts' layout (a copy of the small weights per
        # call; the parameters keep HF's names and shapes)
        gate_up = torch.cat([gate.weight, up.weight]).unsqueeze(0)
        rows = x.shape[0]
        one = torch.zeros(rows, 1, dtype=torch.long, device=x.device)
        weight = torch.ones(rows, 1, dtype=x.dtype, device=x.device)
        return moe_experts(x, one, weight, gate_up, down.weight.unsqueeze(0), self.limit, self.backend,
                           gate_up_lora=_stacked_term((gate, up)),
                           down_lora=_stacked_term((down,)))


def _stacked_term(parts: tuple[Projection, ...]) -> ExpertLora | None:
    """The low-rank terms of weights stacked by rows (``gate_proj`` over ``up_proj``) as one expert's pair: ``a``
    the terms' ``a`` stacked ``[r_1 + r_2, in]``, ``b`` block-diagonal ``[out_1 + out_2, r_1 + r_2]``; None without
    terms. The parts come from one LoRA group: all or none of them have a term, with one scale."""
    terms = [p.term for p in parts]
    if all(t is None for t in terms):
        return None
    if any(t is None for t in terms) or len({t.scale for t in terms}) > 1:
        raise ValueError("the shared expert's gate, up and down projections take LoRA together, with one scale "
                         f"(got terms on {sum(t is not None for t in terms)} of {len(terms)} stacked projections)")
    a = torch.cat([t.a for t in terms])
    b = torch.block_diag(*[t.b for t in terms])
    return ExpertLora(a.unsqueeze(0), b.unsqueeze(0), terms[0].scale)


class MoE(nn.Module):
    """``routed(x) + shared(x)`` on packed rows ``x [T, D]``.

    After each forward ``last_load [E]`` (int64) holds how many real tokens chose each expert (for
    :meth:`Router.update_bias`). ``backend`` is the routed experts' path (see :class:`Experts`). The experts run
    over row chunks of at most ``chunk_rows`` tokens (each row's result is the same; only the temporaries of one
    pass shrink). With :meth:`use_expert_parallel` the routed experts are split over a process group and the
    tokens exchanged around them (``expert_parallel.py``); the router and the shared expert stay local.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, vocab_size: int,
                 hashed: bool, scoring_func: str, routed_scaling_factor: float, swiglu_limit: float,
                 backend: BackendChoice = "auto", chunk_rows: int = 65536, local_experts: range | None = None) -> None:
        super().__init__()
        self.chunk_rows = chunk_rows
        self.gate = Router(hidden_size, num_experts, top_k, vocab_size, hashed, scoring_func, routed_scaling_factor)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, swiglu_limit, backend, local_experts)
        self.shared_experts = SharedExpert(hidden_size, intermediate_size, swiglu_limit, backend)
        self.last_load: Tensor | None = None
        self.ep: ExpertParallel | None = None

    def use_expert_parallel(self, ep: ExpertParallel) -> None:
        """Keep only this rank's experts (``ep.local_experts``, sliced from the current tensors, or fresh meta
        tensors on the meta device) and exchange tokens over ``ep.group`` from now on."""
        if ep.num_experts != self.gate.num_experts:
            raise ValueError(f"ep.num_experts ({ep.num_experts}) != the layer's {self.gate.num_experts} experts")
        old = self.experts
        if len(old.local) != old.num_experts:
            raise ValueError("the experts are already split over an expert-parallel group")
        # the experts module slices itself (full-precision or FP8-held alike)
        self.experts, self.ep = old.subset(ep.local_experts), ep

    def forward(self, x: Tensor, input_ids: Tensor | None = None, real: Tensor | None = None) -> Tensor:
        """``x [T, D]``; ``input_ids [T]`` (hash layers); ``real [T]`` bool marks rows counted in ``last_load``."""
        weights, experts = self.gate(x, input_ids)
        with torch.no_grad():  # a scatter-add on the device: no boolean indexing, no bincount (both read the host)
            self.last_load = expert_load(experts, self.gate.num_experts, real)
        routed = self.experts if self.ep is None else self._routed_ep
        step = self.chunk_rows
        if x.shape[0] <= step:
            return routed(x, experts, weights) + self.shared_experts(x)
        # row views of x: what each chunk's backward saves is x itself, not copies
        return torch.cat([routed(x[lo:lo + step], experts[lo:lo + step], weights[lo:lo + step])
                          + self.shared_experts(x[lo:lo + step]) for lo in range(0, x.shape[0], step)])

    def _routed_ep(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """The routed experts over the expert-parallel group: dispatch, local grouped GEMMs, combine."""
        ep = self.ep
        t, k = experts.shape
        plan = route_plan(experts, ep.num_experts)  # assignments by expert, so by destination rank
        order, inv = plan.order, plan.inv
        counts = torch.diff(plan.offs.long(), prepend=plan.offs.new_zeros(1, dtype=torch.long))
        per_source, send, recv = exchange_counts(counts, ep)
        # rows and their routing weights in one exchange, so every rank's backward runs the same collectives in
        # the same order whatever its autograd graph looks like
        packet = torch.cat([x.index_select(0, plan.token), weights.reshape(-1, 1).index_select(0, order).to(x.dtype)],
                           dim=1)
        got = all_to_all_rows(packet, send, recv, ep.group)
        rows, w = got[:, :-1], got[:, -1:]
        # local expert of each received row: source-major, then expert-major within a source
        n_local = len(self.experts.local)
        ids = torch.arange(n_local, device=x.device).repeat(ep.size)
        local_ids = torch.repeat_interleave(ids, per_source.reshape(-1), output_size=sum(recv))
        y = self.experts(rows, local_ids[:, None], w)
        if sum(recv) == 0:  # no rows here: the backward must still reach the exchange and the experts (zeros)
            y = with_zero_grads(y, [got, *(p for p in self.experts.parameters() if p.requires_grad)])
        back = all_to_all_rows(y, recv, send, ep.group)  # [T * k, D] in expert order
        compute = torch.promote_types(x.dtype, torch.float32)
        return back.index_select(0, inv).view(t, k, -1).sum(1, dtype=compute).to(x.dtype)
