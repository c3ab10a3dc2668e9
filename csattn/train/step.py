"""One optimizer step on a sharded model: forward and backward of this rank's rows, the global gradient norm and
clipping, AdamW, and the router-bias update from the global expert loads.

Normalization: every rank's loss is its rows' summed cross entropy over the label count of the whole global
batch (all data replicas), and its indexer-loss gradient is scaled by its replica's share of the global real rows,
so the sum of the ranks' gradients, which FSDP's reduction forms (divide factor 1), is the gradient of the global
batch in one process.

Non-finite steps: flags for this rank's loss and the global gradient norm, summed over the ranks with the losses in
one all-reduce, so every rank decides alike; a step whose loss or gradient norm is NaN / inf is skipped: no
optimizer step (weights and AdamW state unchanged), no router-bias update, gradients dropped. ``finish()`` reads
flags and metrics in the step's one host sync, after the host has built the next batch while the device ran the
backward, then launches the optimizer step without waiting for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..layers.plan import ContextParallelGroup
from ..models.deepseek_v4 import DeepseekV4ForCausalLM
from ..packing import PackedSeqs
from ..parallel.mesh import Meshes
from .errors import TrainingStopped
from .packer import PackedBatch

__all__ = ["TrainState", "train_step", "BadSteps", "clip_grad_norm", "all_sum"]


@dataclass
class TrainState:
    """What a step works on, built once by the build phase (``build.py``) and saved / restored by the checkpoint
    phase: the sharded model and its ``ContextParallel`` (``cp``, None without context parallelism), AdamW and its LR
    schedule, the meshes and device, and the options a step reads (``grad_clip``: 0 = no clipping;
    ``router_bias_rate``: 0 with a frozen router)."""

    model: DeepseekV4ForCausalLM
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    meshes: Meshes
    device: torch.device
    cp: ContextParallelGroup | None = None
    grad_clip: float = 0.0
    router_bias_rate: float = 0.0


def all_sum(x: Tensor, meshes: Meshes) -> Tensor:
    """``x`` summed over every rank (in place; identity in one process)."""
    if meshes.distributed:
        dist.all_reduce(x)
    return x


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def clip_grad_norm(model: nn.Module, max_norm: float, meshes: Meshes) -> Tensor:
    """The global L2 norm of every gradient (the routed experts summed over ``ep`` too), before clipping; when
    ``max_norm > 0`` the gradients are scaled to it (the same coefficient on every rank)."""
    from torch.distributed.tensor import DTensor

    params: dict[bool, list[Tensor]] = {False: [], True: []}  # DTensors of one mesh per call
    for name, p in model.named_parameters():
        if p.grad is not None:
            params[_is_expert(name)].append(p)
    squares = []
    for expert, group in params.items():
        if not group:
            continue
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        sq = norm.double() ** 2
        if expert and meshes.dims.ep > 1:  # each ep rank holds other experts
            dist.all_reduce(sq, group=meshes.ep_group)
        squares.append(sq)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros((), dtype=torch.float64)
    if max_norm > 0:
        for group in params.values():
            if group:
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].device))
    return total


def _to_device(batch: PackedBatch, device: torch.device) -> tuple[PackedSeqs, Tensor, Tensor]:
    packed = batch.packed
    packed = type(packed)(cu_seqlens=packed.cu_seqlens.to(device), cu_seqlens_padded=packed.cu_seqlens_padded
                          .to(device), max_seqlen=packed.max_seqlen)
    return packed, batch.input_ids.to(device), batch.labels.to(device)


def train_step(state: TrainState, batch: PackedBatch, save_due: bool = False) -> Callable[[], dict[str, Any]]:
    """One optimizer step of ``state`` on this rank's data-replica stream ``batch``, launched: returns ``finish()``,
    which waits for the step, launches the optimizer step, advances the LR schedule and gives the step's global
    metrics (identical on every rank). Between the two the host is free while the device runs the step's tail (the
    loop builds the next batch there). ``save_due``: this rank's clock says a time-based checkpoint is due;
    ``finish()["save_due"]`` is true when any rank's says so."""
    model, optimizer, meshes, cp, device = state.model, state.optimizer, state.meshes, state.cp, state.device
    packed, ids, labels = _to_device(batch, device)
    # label counts and real rows of the whole global batch: the loss denominators (CP ranks of a replica hold the
    # same batch, so their sum counts it cp times)
    # on the device (NCCL reduces device tensors only); the scale stays a tensor, read by the backward, no host sync
    local = torch.cat([(labels != -100).sum(dim=1), labels.new_tensor([batch.num_tokens])]).double()
    totals = all_sum(local.clone(), meshes) / meshes.dims.cp
    counts, share = totals[:-1].float(), local[-1] / totals[-1].clamp_min(1)
    if cp is not None:
        ids = cp.shard(ids, packed)
        labels = cp.shard(labels.t().contiguous(), packed).t()
    optimizer.zero_grad(set_to_none=True)
    out = model(ids, packed=packed, cp=cp, labels=labels[0], mtp_labels=labels[1:] if len(model.mtp) else None,
                label_counts=counts.to(device), return_logits=False, indexer_loss_scale=share)
    out.loss.backward()
    grad_norm = clip_grad_norm(model, state.grad_clip, meshes)  # global (over every rank) already
    zero = torch.zeros((), device=device, dtype=torch.float64)
    loss = out.loss.detach().double()
    # this rank's shares of the losses, its non-finite flags (loss, global gradient norm) and its save clock, summed
    # over the ranks in one collective: a flag above 0 means some rank raised it
    summed = all_sum(torch.stack([
        loss, out.lm_loss.double(),
        out.indexer_loss.double() * share if out.indexer_loss is not None else zero,
        torch.stack(out.mtp_losses).double().mean() if out.mtp_losses else zero,
        (~torch.isfinite(loss)).double(), (~torch.isfinite(grad_norm)).double().to(device),
        torch.full((), float(save_due), device=device, dtype=torch.float64),
    ]), meshes)
    values = torch.cat([summed, grad_norm.detach().double().reshape(1).to(device)])
    has_mtp = bool(out.mtp_losses)

    def finish() -> dict[str, Any]:
        # every rank calls finish once per step, in step order, so the collectives pair up. The one host read of the
        # step comes before the optimizer step, which the host then only launches.
        loss, lm, idx, mtp, loss_bad, norm_bad, due, norm = values.tolist()  # the same on every rank
        nonfinite = " and ".join(n for n, b in (("loss", loss_bad), ("gradient norm", norm_bad)) if b) or None
        if nonfinite is None:
            optimizer.step()
            loads = model.expert_loads()
            if loads and state.router_bias_rate > 0:  # balancing from every rank's loads: the same bias everywhere
                stacked = all_sum(torch.stack([x.to(torch.float32) for x in loads]), meshes)
                model.update_router_biases(list(stacked), state.router_bias_rate)
        else:
            optimizer.zero_grad(set_to_none=True)  # the non-finite gradients reach nothing
        # a skipped (non-finite) step advances the schedule too: the LR stays a function of the step number, so
        # --steps ends the decay where it says and a resumed run continues the same curve
        state.scheduler.step()
        return {"loss": loss, "lm_loss": lm, "indexer_loss": idx, "mtp_loss": mtp if has_mtp else None,
                "grad_norm": norm, "nonfinite": nonfinite, "save_due": due > 0}

    return finish


class BadSteps:
    """Counts non-finite (skipped) steps in a row: a warning line for each (through ``say``, rank 0),
    :class:`TrainingStopped` at ``max_bad_steps``. Every rank got the same all-reduced verdict from the step, so
    every rank stops alike."""

    def __init__(self, max_bad_steps: int, output: str | None) -> None:
        self.max_bad_steps, self.output, self.run = max_bad_steps, output, 0

    def check(self, step: int, nonfinite: str | None, say: Callable[[str], None]) -> None:
        if nonfinite is None:
            self.run = 0
            return
        self.run += 1
        bad_run, limit = self.run, self.max_bad_steps
        say(f"warning: step {step}: non-finite {nonfinite}: step skipped (weights, optimizer state and router "
            f"biases unchanged; {bad_run} in a row, the run stops at --max-bad-steps {limit})")
        if bad_run >= limit:
            where = f"the latest checkpoint under {self.output}" if self.output else "a checkpoint"
            raise TrainingStopped(
                f"steps {step - bad_run + 1}..{step}: {bad_run} non-finite steps in a row (--max-bad-steps "
                f"{limit}; the last one: non-finite {nonfinite}); the run stopped with the weights of step "
                f"{step - bad_run}. Resume from {where} (--resume auto) with a lower --lr, more --warmup-steps or a "
                "--grad-clip; a non-finite loss from the first step on points at the data or the --init-from weights")
