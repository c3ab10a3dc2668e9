"""The planner's records: what one plan holds (:class:`Plan`), the trained elements and frozen bytes it is built from
(:class:`Part`, :class:`Sizes`), and the device a plan must fit (the H200)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

__all__ = ["GiB", "H200_BYTES", "HEADROOM", "LIMIT_BYTES", "Memory", "Part", "Plan", "Sizes"]

GiB = 2**30
H200_BYTES = 139.8 * GiB  # the H200's memory as torch.cuda reports it (shared/GPU.md)
HEADROOM = 0.05  # left to the caching allocator (fragmentation, reserved-but-free blocks)
LIMIT_BYTES = (1 - HEADROOM) * H200_BYTES  # a plan fits when its peak is at most this


@dataclass(frozen=True)
class Memory:
    """One rank's memory by term (bytes). The terms never all peak at once: :attr:`Plan.peak` decides the fit."""

    parameters: float = 0.0  # weights as stored: fp32 masters of what trains (sharded), frozen weights as held
    gradients: float = 0.0  # of what trains, all of them (at the backward's end)
    optimizer: float = 0.0  # AdamW's two moments
    gathered_units: float = 0.0  # compute copies of the FSDP units in flight
    comm_buffers: float = 0.0  # reduce-scatter and all-gather buffers, EP all-to-all, CP halo
    activations_kept: float = 0.0  # for the backward
    workspaces: float = 0.0  # the backward's transient memory
    fp8_workspace: float = 0.0  # the GEMMs of frozen FP8-held weights (none without them)

    @property
    def total(self) -> float:
        """Every term at once (never reached)."""
        return sum(getattr(self, f.name) for f in fields(self))

    def terms(self) -> list[tuple[str, float]]:
        """``(name, bytes)`` of each term in table order, named as printed (``gathered units``); the FP8 workspace
        only when there is one."""
        return [(f.name.replace("_", " "), getattr(self, f.name)) for f in fields(self)
                if f.name != "fp8_workspace" or self.fp8_workspace]


@dataclass
class Plan:
    """One mesh's per-rank memory (bytes) and estimated step time (seconds). ``peak`` decides ``fits``;
    ``total`` (every term at once) is never reached."""

    config: str
    gpus: int
    seq_len: int
    batch_seqs: int
    dims: dict[str, int]
    recompute: str
    dtype: str
    sharded: bool
    params_total: int
    rows: int  # stream rows a rank processes per step
    training: dict = field(default_factory=dict)  # train / lora_rank / lora_targets / base_precision
    params_trained: int = 0  # trained in full, plus the LoRA parameters
    params_lora: int = 0
    memory: Memory = field(default_factory=Memory)
    total: float = 0.0
    peak: float = 0.0
    peak_at: str = ""
    limit: float = LIMIT_BYTES
    fits: bool = False
    time: dict[str, float] = field(default_factory=dict)
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    config_path: str = ""


@dataclass(frozen=True)
class Part:
    """Elements trained (matrices incl. LoRA / vectors) and bytes of frozen storage of some groups."""

    trained: float = 0.0
    trained_small: float = 0.0
    frozen: float = 0.0

    @property
    def train_elems(self) -> float:
        return self.trained + self.trained_small


@dataclass(frozen=True)
class Sizes:
    """:class:`Part` of the whole model, the largest block (an FSDP unit) and the root, dense and routed experts
    apart (they shard over different meshes)."""

    dense: Part
    experts: Part
    unit_dense: Part
    unit_experts: Part
    root: Part
    head_trained: float  # trained elements of the LM head (the embedding's when tied)
    blocks: int


