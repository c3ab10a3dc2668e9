"""LoRA on the model's linears and routed experts, added from outside (the model knows no LoRA).

Three kinds, by how the layer uses the weight:

* a linear called as a module (``q_a_proj``, ``kv_proj``, the compressors' projections, the indexer's scorer):
  :class:`LoraLinear`, ``y = base(x) + scale * B(A(dropout(x)))``;
* a linear whose weight the layer reads directly (the attention core's ``q_b_proj``, ``o_a_proj`` (grouped),
  ``o_b_proj``, the indexer's ``q_b_proj``, the shared expert's three): :class:`LoraWeight` holds the factors, and
  the module that reads the weight (the attention layer, the shared expert) reads it through its
  ``projection(name)``, which its LoRA subclass (:class:`LoraReader`) returns with the low-rank term
  (:class:`~csattn.layers.modules.Projection`); the module runs it factored, ``x W^T + scale (x A^T) B^T`` (the
  attention core by hand, the shared expert through the grouped GEMMs as one expert's pair), so a frozen ``W``
  costs no weight-gradient GEMM of its size (only the capture-safe custom ops, which carry one weight, take it
  merged, ``W + scale B A``). ``weight`` stays the plain parameter (FSDP2 finds its parameters again
  by ``getattr`` after moving them). Input dropout is refused there: the fused paths do not apply it (PEFT refuses
  it for ``target_parameters`` too);
* the routed experts: :class:`LoraExperts`, a pair per expert through the grouped GEMMs
  (:class:`csattn.ops.moe.ExpertLora`), never forming ``W + BA`` for all experts.

``scale = alpha / r``; ``B`` starts at zero, so the adapted model equals the base bit for bit at step 0; ``A`` is
drawn as PEFT draws it (kaiming-uniform with ``a = sqrt(5)``: uniform in ``+-1/sqrt(in)``), each tensor (each
expert) from its own generator seeded by the run seed and its name (and global expert id), so the initial
adapter does not depend on the mesh. The class of an adapted module is swapped for a subclass (as FSDP2 does);
its base parameters keep their names, the factors are new parameters beside them (``lora_A``, ``lora_B``;
experts: ``lora_A_gate_up`` ...). The MTP blocks, which Hugging Face's model does not build, take no LoRA.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..layers.attention import HybridAttention
from ..layers.modules import GroupedLinear, LowRankTerm, Projection, linear
from ..models.deepseek_v4.moe import Experts
from ..ops.autograd import with_zero_grads
from ..ops.moe import ExpertLora, moe_experts
from .groups import group_of

__all__ = ["LoraSpec", "LoraLinear", "LoraWeight", "LoraReader", "LoraExperts", "add_lora", "lora_modules", "init_lora",
           "lora_delta", "WEIGHT_READ"]

# linears whose weight the layer reads directly (relative to a decoder layer)
WEIGHT_READ = (*(f"self_attn.{n}" for n in HybridAttention.READ_PROJECTIONS), "mlp.shared_experts.gate_proj",
               "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")


@dataclass(frozen=True)
class LoraSpec:
    """Rank, alpha, dropout and the groups adapted (``csattn.finetune.groups.LORA_GROUPS``)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class _Factors:
    """The LoRA pair of a 2-D weight ``[out, in]``: ``lora_A [r, in]``, ``lora_B [out, r]``."""

    lora_scale: float

    def _add_factors(self, spec: LoraSpec) -> None:
        w = self._parameters["weight"]
        out, inp = w.shape
        self.lora_A = nn.Parameter(torch.zeros(spec.rank, inp, dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(out, spec.rank, dtype=w.dtype, device=w.device))
        self.lora_scale = spec.scale

    def delta(self) -> Tensor:
        """``scale * B @ A`` ``[out, in]``."""
        return self.lora_scale * (self.lora_B @ self.lora_A)


class LoraLinear(nn.Linear, _Factors):
    """An ``nn.Linear`` called as a module: ``base(x) + scale * B(A(dropout(x)))``."""

    lora_dropout: nn.Module

    def forward(self, x: Tensor) -> Tensor:
        term = LowRankTerm(self.lora_A, self.lora_B, self.lora_scale)
        return linear(x, Projection(self.weight, term), self.bias, term_input=self.lora_dropout(x))


class LoraWeight(_Factors):
    """Mixin over a linear whose weight the layer reads: the factors, which its reader (:class:`LoraReader`) adds
    to the weight it multiplies by; ``weight`` stays the parameter ``W``."""


class LoraReader:
    """Mixin over a module that reads its linears' weights through ``projection(name)`` (the attention layer, the
    shared expert): the weight with the low-rank term ``(A, B, scale)`` (no dropout) where the linear ``name`` is a
    :class:`LoraWeight`; the module runs it factored."""

    def projection(self, name: str) -> Projection:
        p = super().projection(name)
        module = self.get_submodule(name)
        if not isinstance(module, LoraWeight):
            return p
        w = p.weight
        return Projection(w, LowRankTerm(module.lora_A.to(w.dtype), module.lora_B.to(w.dtype), module.lora_scale))


class LoraExperts(Experts):
    """Routed experts with a LoRA pair per expert on ``gate_up_proj`` and ``down_proj`` (PEFT's layout for 3-D
    ``target_parameters`` per expert: ``A [E, r, in]``, ``B [E, out, r]``)."""

    lora_scale: float

    def _add_factors(self, spec: LoraSpec) -> None:
        n, two_i, d = self.gate_up_proj.shape
        # FP8-held experts: the factors take the dtype the experts compute in, not their codes'
        dt = getattr(self, "compute_dtype", self.gate_up_proj.dtype)
        r, dev = spec.rank, self.gate_up_proj.device
        self.lora_A_gate_up = nn.Parameter(torch.zeros(n, r, d, dtype=dt, device=dev))
        self.lora_B_gate_up = nn.Parameter(torch.zeros(n, two_i, r, dtype=dt, device=dev))
        self.lora_A_down = nn.Parameter(torch.zeros(n, r, two_i // 2, dtype=dt, device=dev))
        self.lora_B_down = nn.Parameter(torch.zeros(n, d, r, dtype=dt, device=dev))
        self.lora_scale = spec.scale

    def factors(self) -> list[Tensor]:
        return [self.lora_A_gate_up, self.lora_B_gate_up, self.lora_A_down, self.lora_B_down]

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        s = self.lora_scale
        gate_up, down, held = self.moe_operands()  # bf16 parameters, or FP8 codes with their scales
        y = moe_experts(x, experts, weights, gate_up, down, self.limit, self.backend,
                        gate_up_lora=ExpertLora(self.lora_A_gate_up, self.lora_B_gate_up, s),
                        down_lora=ExpertLora(self.lora_A_down, self.lora_B_down, s), **held)
        if x.shape[0] == 0:  # an expert-parallel rank without rows: every rank reduces the same gradients
            y = with_zero_grads(y, self.factors())
        return y


def _weight_read_class(cls: type) -> type:
    return type(f"Lora{cls.__name__}", (LoraWeight, cls), {})


def _lora_reader_class(cls: type) -> type:
    return _READER_CLASSES.setdefault(cls, type(f"Lora{cls.__name__}", (LoraReader, cls), {}))


def _lora_experts_class(cls: type) -> type:
    """:class:`LoraExperts` over ``cls``: the class itself for plain experts, a subclass of both for others (the
    FP8-held experts), whose :meth:`Experts.moe_operands` the adapter's forward runs."""
    if cls is Experts or issubclass(cls, LoraExperts):
        return LoraExperts
    return _EXPERT_CLASSES.setdefault(cls, type(f"Lora{cls.__name__}", (LoraExperts, cls), {}))


_EXPERT_CLASSES: dict[type, type] = {}
_READER_CLASSES: dict[type, type] = {}
_WEIGHT_CLASSES: dict[type, type] = {nn.Linear: _weight_read_class(nn.Linear),
                                     GroupedLinear: _weight_read_class(GroupedLinear)}


def _targets(model: nn.Module, spec: LoraSpec) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module that takes LoRA: the targeted groups' linears and experts in the decoder
    layers (not the MTP blocks)."""
    out = []
    for name, module in model.named_modules():
        if not name.startswith("model.layers."):
            continue
        if isinstance(module, Experts) or (isinstance(module, (nn.Linear, GroupedLinear))):
            if group_of(name + (".gate_up_proj" if isinstance(module, Experts) else ".weight")) in spec.targets:
                out.append((name, module))
    return out


def add_lora(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Put LoRA on the modules of the targeted groups (in place; the factors are zeros until :func:`init_lora`)
    and return their names. Call after the experts are split over an expert-parallel group (``use_expert_parallel``
    replaces the experts module) and before FSDP wraps the model; base parameters are left as they are (freeze
    them with :func:`csattn.finetune.groups.apply_freezing`).

    Raises ``ValueError`` for ``dropout > 0`` when a targeted linear's weight is read directly (see the module
    docstring), naming the groups.
    """
    if lora_modules(model):
        raise ValueError("the model already has LoRA modules: add_lora runs once per model")
    targets = _targets(model, spec)
    if spec.dropout > 0:
        # the routed experts too: their LoRA runs through the grouped GEMMs, with no input dropout
        read = sorted({group_of(n + (".gate_up_proj" if isinstance(m, Experts) else ".weight")) for n, m in targets
                       if isinstance(m, Experts) or _reads_weight(n, m)})
        if read:
            raise ValueError(f"--lora-dropout {spec.dropout}: the groups {', '.join(read)} have linears whose weight "
                             "the layer reads directly (the attention core's q_b / o_a / o_b projections, the "
                             "indexer's q_b_proj, the shared and routed experts), whose fused paths apply no "
                             "input dropout to LoRA's term (PEFT refuses it for target_parameters too): "
                             "pass --lora-dropout 0, or --lora-targets compressor only")
    readers: set[str] = set()
    for name, module in targets:
        if getattr(module, "frozen_storage", None) and not isinstance(module, Experts):
            raise ValueError(f"{name}: LoRA on a dense linear held in FP8 is not supported; load the dense linears in "
                             "bf16 (the default: only the routed experts are held in FP8) or leave their group out "
                             "of --lora-targets")
        if isinstance(module, Experts):
            module.__class__ = _lora_experts_class(type(module))
        elif _reads_weight(name, module):
            module.__class__ = _WEIGHT_CLASSES[type(module)]
            readers.add(_reader(name))
        else:
            module.__class__ = LoraLinear
            module.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        module._add_factors(spec)
    for path in sorted(readers):
        reader = model.get_submodule(path)
        if not isinstance(reader, LoraReader):
            reader.__class__ = _lora_reader_class(type(reader))
    return [n for n, _ in targets]


def _reader(name: str) -> str:
    """The module whose forward reads the weight of linear ``name``: the attention layer (its core and the
    indexer's queries) or the shared expert."""
    for part in (".self_attn.", ".mlp.shared_experts."):
        if part in name:
            return name[: name.index(part) + len(part) - 1]
    raise ValueError(f"no reader known for {name!r}")


def _reads_weight(name: str, module: nn.Module) -> bool:
    return isinstance(module, GroupedLinear) or name.split(".", 3)[-1] in WEIGHT_READ


def lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every adapted module, in the model's order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (_Factors, LoraExperts))]


def _seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**62)


def init_lora(model: nn.Module, seed: int, copy=None) -> None:
    """Draw every ``A`` (kaiming-uniform, ``a = sqrt(5)``, as PEFT) and zero every ``B``. Each linear's ``A`` comes
    from its own generator (the run ``seed`` and the module's name), each expert's from one of its own (plus its
    global id): the same values whatever the mesh. ``copy(dest, full)`` writes a full tensor into a parameter
    (default ``dest.copy_``; sharded parameters need :func:`csattn.parallel.copy_into`'s per-rank shard copy)."""
    copy = copy or (lambda dest, full: dest.copy_(full))
    with torch.no_grad():
        for name, module in lora_modules(model):
            if isinstance(module, LoraExperts):
                pairs = [("gate_up", module.lora_A_gate_up, module.lora_B_gate_up),
                         ("down", module.lora_A_down, module.lora_B_down)]
                for which, a, b in pairs:
                    shape = (len(module.local), *a.shape[1:])
                    full = torch.stack([_kaiming(shape[1:], _seed(seed, f"{name}.{which}") + e)
                                        for e in module.local])
                    copy(a, full.to(a.dtype))
                    copy(b, torch.zeros(b.shape, dtype=b.dtype))
            else:
                a, b = module.lora_A, module.lora_B
                copy(a, _kaiming(tuple(a.shape), _seed(seed, name)).to(a.dtype))
                copy(b, torch.zeros(b.shape, dtype=b.dtype))


def _kaiming(shape: tuple[int, ...], seed: int) -> Tensor:
    """``[r, in]`` uniform in ``+-1/sqrt(in)``: ``kaiming_uniform_(a=sqrt(5))`` (PEFT's ``lora_A`` init), fp32 on the
    CPU from its own generator."""
    bound = 1.0 / math.sqrt(shape[-1])
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


def lora_delta(module: nn.Module) -> dict[str, Tensor]:
    """The weight change of an adapted module, ``{param name: scale * B @ A}`` (per expert for the experts), in
    fp32 at least (full tensors: call on gathered factors)."""
    if isinstance(module, LoraExperts):
        s = module.lora_scale
        c = torch.promote_types(module.lora_A_gate_up.dtype, torch.float32)
        return {"gate_up_proj": s * torch.bmm(module.lora_B_gate_up.to(c), module.lora_A_gate_up.to(c)),
                "down_proj": s * torch.bmm(module.lora_B_down.to(c), module.lora_A_down.to(c))}
    c = torch.promote_types(module.lora_A.dtype, torch.float32)
    return {"weight": module.lora_scale * (module.lora_B.to(c) @ module.lora_A.to(c))}

