"""The named device meshes of a run: data parallel (replicated x sharded) x context parallel, experts over ``ep``.

Rank layout (row-major, the names torchtitan uses)::

    world = dp_replicate x dp_shard x cp            rank = (r * dp_shard + s) * cp + c
    FSDP shards every dense parameter over dp_shard x cp ("dp_shard_cp") and replicates over dp_replicate
    ep groups are consecutive runs of ep ranks inside dp_shard x cp; efsdp = dp_shard * cp / ep shards the
    experts of one ep rank (and dp_replicate replicates them)

A data replica is one (r, s) pair: its cp ranks read the same packed batch and each keeps its own rows. Expert
parallelism takes its ranks from dp_shard x cp, so it adds no GPUs: it changes which ranks hold which experts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ParallelDims", "Meshes", "build_meshes", "check_launch", "launch_world_size"]


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh dimensions. ``dp_shard=-1`` takes what the other sizes leave of ``world``."""

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    ep: int = 1
    world: int = 1

    def resolve(self) -> ParallelDims:
        """The sizes with ``dp_shard`` filled in, checked against ``world`` (``ValueError`` naming the flag)."""
        for name in ("dp_replicate", "cp", "ep", "world"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        shard = self.dp_shard
        if self.world == 1 and max(self.dp_replicate, self.cp, self.ep, shard) > 1:
            # the usual mistake: one process per rank is started by torchrun
            flags = " ".join(f"--{n.replace('_', '-')} {v}" for n, v in (("dp_replicate", self.dp_replicate),
                             ("dp_shard", shard), ("cp", self.cp), ("ep", self.ep)) if v > 1)
            ranks = self.dp_replicate * max(shard, 1) * self.cp
            ranks = max(ranks, self.ep)
            raise ValueError(f"{flags} needs {ranks} processes (one per rank) but this is a single process: run "
                             f"`torchrun --nproc-per-node {ranks} -m csattn train {flags} ...`")
        if shard == -1:
            if self.world % (self.dp_replicate * self.cp):
                raise ValueError(f"world size {self.world} is not divisible by --dp-replicate {self.dp_replicate} x "
                                 f"--cp {self.cp}: start a multiple of {self.dp_replicate * self.cp} processes "
                                 "(torchrun --nproc-per-node) or change the sizes")
            shard = self.world // (self.dp_replicate * self.cp)
        if not isinstance(shard, int) or shard < 1:
            raise ValueError(f"--dp-shard must be a positive integer or -1 (the rest of the world), got {shard!r}")
        if self.dp_replicate * shard * self.cp != self.world:
            hint = (f"run `torchrun --nproc-per-node {self.dp_replicate * shard * self.cp} -m csattn train ...`"
                    if self.world == 1 else "change the sizes (--dp-shard -1 takes what the others leave) or the "
                    "number of processes (torchrun --nproc-per-node x --nnodes)")
            raise ValueError(f"--dp-replicate {self.dp_replicate} x --dp-shard {shard} x --cp {self.cp} = "
                             f"{self.dp_replicate * shard * self.cp} ranks, but the world size is {self.world}: {hint}")
        if (shard * self.cp) % self.ep:
            raise ValueError(f"--ep {self.ep} must divide --dp-shard x --cp = {shard * self.cp} (expert parallelism "
                             "takes its ranks from the sharded data-parallel and context-parallel ranks)")
        return replace(self, dp_shard=shard)

    @property
    def dp(self) -> int:
        """Data replicas: ranks that read different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        return self.fsdp // self.ep

    def check_fp8_experts(self) -> None:
        """Routed experts frozen in FP8 are split by expert parallelism alone: each rank holds and reads only its
        own experts, whole (FSDP would all-gather them in its compute dtype, a bf16 copy of each layer's experts).
        ``ValueError`` naming ``--ep`` unless it is ``dp_shard x cp`` (efsdp 1). On resolved sizes."""
        if self.efsdp > 1:
            raise ValueError(f"--ep {self.ep}: routed experts frozen in FP8 are split by expert parallelism alone "
                             f"(each rank holds and reads only its own experts): use --ep {self.dp_shard * self.cp} "
                             "(dp_shard x cp)")

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s index along every named dimension."""
        c = rank % self.cp
        s = rank // self.cp % self.dp_shard
        r = rank // (self.cp * self.dp_shard)
        f = s * self.cp + c
        return {"dp_replicate": r, "dp_shard": s, "cp": c, "dp": r * self.dp_shard + s, "ep": f % self.ep,
                "efsdp": f // self.ep}


@dataclass
class Meshes:
    """This rank's meshes and groups (all ``None`` in a single process, where nothing is distributed).

    Attributes:
        dims: the resolved sizes. rank: the global rank.
        dense: ``("dp_replicate", "dp_shard_cp")``: FSDP of every parameter but the routed experts.
        experts: ``("dp_replicate", "ep", "efsdp")``: FSDP of the routed experts is its
            ``["dp_replicate", "efsdp"]``; with ``ep`` it also gives the experts' global (checkpoint) layout.
        cp_group / ep_group: the process groups the model's ``ContextParallel`` / ``ExpertParallel`` use.
    """

    dims: ParallelDims
    rank: int = 0
    dense: Any = None
    experts: Any = None
    cp_group: Any = None
    ep_group: Any = None

    @property
    def distributed(self) -> bool:
        return self.dims.world > 1

    @cached_property
    def coords(self) -> dict[str, int]:
        return self.dims.coords(self.rank)


def launch_world_size() -> int:
    """The number of processes of this run, known before any process group exists: the default group's size once
    it is initialized, else torchrun's ``WORLD_SIZE`` (1 without it)."""
    if dist.is_initialized():
        return dist.get_world_size()
    text = os.environ.get("WORLD_SIZE", "1")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"WORLD_SIZE={text!r} in the environment is not a positive integer: start the processes "
                         "with torchrun (which sets it) or unset it")
    return int(text)


def check_launch(dims: ParallelDims) -> ParallelDims:
    """``dims`` resolved against :func:`launch_world_size`: the check :func:`build_meshes` makes, made before the
    process group starts. Every rank reads the same environment, so every rank raises the same ``ValueError``
    and none is left waiting in the group's rendezvous for a rank that already left."""
    return replace(dims, world=launch_world_size()).resolve()


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    """Build the meshes of ``dims`` over the default process group (every rank calls this, in the same order).

    Raises ``ValueError`` (the same on every rank) when the sizes do not fit the world size.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = replace(dims, world=world).resolve()
    if world == 1:
        return Meshes(dims)
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(world)
    layout = ranks.view(dims.dp_replicate, dims.dp_shard, dims.cp)
    named = DeviceMesh(device_type, layout, mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
    dense = DeviceMesh(device_type, ranks.view(dims.dp_replicate, dims.fsdp),
                       mesh_dim_names=("dp_replicate", "dp_shard_cp"))
    experts = DeviceMesh(device_type, ranks.view(dims.dp_replicate, dims.efsdp, dims.ep).permute(0, 2, 1),
                         mesh_dim_names=("dp_replicate", "ep", "efsdp"))
    return Meshes(dims, dist.get_rank(), dense=dense, experts=experts,
                  cp_group=named["cp"].get_group() if dims.cp > 1 else None,
                  ep_group=experts["ep"].get_group() if dims.ep > 1 else None)
