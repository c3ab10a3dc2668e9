"""Tasks the sharded-training tests run on every rank of a gloo pool (importable, so spawned ranks find them)."""

from __future__ import annotations

from typing import Any

import torch

from csattn.parallel import full_grads, full_state_dict
from csattn.train.run import TrainConfig, train

# fp64, 3 AdamW steps of the tiny model (W / CSA / HCA layers, hash + learned MoE, shared expert, MTP) on packs
# whose documents cross rank boundaries; 4 packed sequences of 64 rows per step on every mesh
BASE = dict(steps=3, seq_len=64, device="cpu", progress=False, warmup_steps=1, dtype="float64", batch_seqs=4,
            pad_multiple=4)


def train_task(group: Any, **kwargs: Any) -> dict[str, Any] | None:
    """``train`` on the pool's ranks; rank 0 returns the losses, the final weights and the last step's gradients."""
    torch.set_num_threads(1)
    result = train(TrainConfig(**{**BASE, **kwargs}))
    state = full_state_dict(result.model, result.meshes)
    grads = full_grads(result.model, result.meshes)
    if result.meshes.rank:
        return None
    return {"losses": result.losses, "indexer": result.indexer_losses, "state": state, "grads": grads}


def reference(**kwargs: Any) -> dict[str, Any]:
    """The same run in this process (world size 1)."""
    from csattn.parallel import Meshes, ParallelDims

    result = train(TrainConfig(**{**BASE, **kwargs}))
    meshes = Meshes(ParallelDims().resolve())
    return {"losses": result.losses, "indexer": result.indexer_losses,
            "state": full_state_dict(result.model, meshes), "grads": full_grads(result.model, meshes)}


def hf_import_task(group: Any, path: str, dims: dict[str, int], export: str | None = None) -> dict[str, Any] | None:
    """Build the checkpoint's model on the meta device, shard it over ``dims``, import ``path`` per rank; rank 0
    returns the gathered weights and which experts each rank read. With ``export``, also write it back there."""
    from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4ModelConfig
    from csattn.models.deepseek_v4.checkpoint import read_config
    from csattn.parallel import ParallelDims, build_meshes, export_hf, load_hf_sharded, parallelize
    from csattn.parallel.init import local_experts

    torch.set_num_threads(1)
    meshes = build_meshes(ParallelDims(**dims), "cpu")
    raw = read_config(path)
    config = DeepseekV4ModelConfig.from_hf(raw, num_nextn_predict_layers=raw.get("num_nextn_predict_layers", 0))
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    parallelize(model, meshes)
    load_hf_sharded(model, path, "cpu")
    held = local_experts(model)
    state = full_state_dict(model, meshes)
    if export:
        export_hf(model, export, meshes)
    return {"state": state, "experts": list(held) if held is not None else None} if meshes.rank == 0 else \
        {"experts": list(held) if held is not None else None}


def moe_ep_task(group: Any, ep: int, hashed_to: list[int] | None, seed: int = 0) -> dict[str, Any]:
    """One MoE layer with its experts split over ``ep`` ranks (the whole world) against the same layer in one
    process: every rank's output rows and the gathered gradients. ``hashed_to``: hash-route every token to these
    experts (so the other ranks receive no rows)."""
    import torch.distributed as dist

    from csattn.models.deepseek_v4.expert_parallel import ExpertParallel
    from csattn.models.deepseek_v4.moe import MoE

    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(seed)
    hashed = hashed_to is not None
    moe = MoE(16, 16, 8, 2, 32, hashed, "sqrtsoftplus", 1.5, 7.0, backend="reference").double()
    if hashed:
        moe.gate.tid2eid.copy_(torch.tensor(hashed_to).expand(32, len(hashed_to)))
    whole = MoE(16, 16, 8, 2, 32, hashed, "sqrtsoftplus", 1.5, 7.0, backend="reference").double()
    whole.load_state_dict(moe.state_dict())
    moe.use_expert_parallel(ExpertParallel(dist.group.WORLD, 8))
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own rows
    x = torch.randn(12 + 2 * rank, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    ids = torch.randint(0, 32, (x.shape[0],), generator=gen)
    dy = torch.randn(x.shape, dtype=torch.float64, generator=gen)
    y = moe(x, input_ids=ids)
    (y * dy).sum().backward()
    local = moe.experts.local
    xs = x.detach().clone().requires_grad_()
    y_ref = whole(xs, input_ids=ids)
    (y_ref * dy).sum().backward()
    # gradients of one process over all ranks' rows: sum the whole layer's over ranks
    full = {n: p.grad.clone() for n, p in whole.named_parameters()}
    for g in full.values():
        dist.all_reduce(g)
    mine = {n: p.grad for n, p in moe.named_parameters()}
    errs = {"y": float((y - y_ref).abs().max()), "x": float((x.grad - xs.grad).abs().max())}
    for n, g in mine.items():
        if n.startswith("experts."):  # this rank's experts, fed by every rank's rows
            ref = full[n][local.start:local.stop]
        else:  # the router and shared expert: this rank's rows' share
            ref = full[n]
            dist.all_reduce(g)
        errs[n] = float((g - ref).abs().max() / ref.abs().max().clamp_min(1e-300))
    loads = moe.last_load.clone()
    dist.all_reduce(loads)
    return {"errs": errs, "received": int(loads[local.start:local.stop].sum())}


def error_task(group: Any, **kwargs: Any) -> str:
    """``train`` expected to fail: returns the error every rank raised (the pool reports it as this rank's error)."""
    torch.set_num_threads(1)
    train(TrainConfig(**{**BASE, "steps": 1, **kwargs}))
    return "no error"
