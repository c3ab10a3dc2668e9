"""Sharded training on PyTorch's own engine: the named ``DeviceMesh`` (``dp_replicate``, ``dp_shard``, ``cp``,
``ep``; ``efsdp``), :func:`parallelize` (FSDP2 units, mixed precision, expert and context parallelism), weights
for a model built on the meta device (fresh or a per-rank HF import), DCP checkpoints, the HF export gathered unit
by unit, and the planner of per-rank memory and step time. The model code knows none of it."""

from .checkpoint import load_sharded, save_sharded
from .export import export_hf, full_grads, full_state_dict
from .init import load_hf_sharded, materialize
from .mesh import Meshes, ParallelDims, build_meshes, check_launch, launch_world_size
from .parallelize import parallelize

__all__ = ["Meshes", "ParallelDims", "build_meshes", "check_launch", "export_hf", "full_grads", "full_state_dict",
           "launch_world_size", "load_hf_sharded", "load_sharded", "materialize", "parallelize", "save_sharded"]
