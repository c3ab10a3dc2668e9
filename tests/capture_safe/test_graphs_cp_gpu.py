"""CUDA-graph capture of a context-parallel layer step: NCCL, one GPU per rank (skipped with fewer than two
GPUs: NCCL refuses two ranks on one GPU, and gloo's collectives copy through host memory, which capture forbids).

Each of two ranks captures ``CapturedLayerStep(..., cp=cp)`` once and replays it on three packs with different
document boundaries; the output rows, input gradient and every parameter gradient of each rank equal the eager
capture-safe CP step on the same pack, for W, CSA and HCA layers: bitwise on the reference backend (deterministic
algorithms, fp32), within bf16 rounding on the Triton backend.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from csattn.cp import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

PACKS = [([100, 50, 60], [128, 64, 64]), ([128, 3, 90], [128, 32, 96]), ([0, 120, 61], [64, 128, 64])]
MAX_SEQLEN = 128
# a rank still running after HANG_S seconds dumps its stacks and exits, so a hang fails with a traceback
HANG_S = float(os.environ.get("CSATTN_TEST_HANG_S", 150))


def _worker(rank: int, world: int, port: int, layer_type: str, backend: str, out, log_path: str) -> None:
    import torch.distributed as dist

    from csattn import ContextParallel, PackedSeqs
    from csattn.capture_safe import CapturedLayerStep, CaptureSafePackedSeqs
    from tests.helpers import grads, random_layer, rel_err, tiny_config

    log = open(log_path, "w", buffering=1)
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=log)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    if backend == "reference":
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        dtype = torch.float32 if backend == "reference" else torch.bfloat16
        cfg = tiny_config(layer_type, backend=backend, hidden_size=64, num_heads=4, head_dim=64, rope_head_dim=16,
                          q_lora_rank=32, index_head_dim=32, sliding_window=16, index_topk=8)
        layer = random_layer(cfg, dtype=torch.float32).to("cuda", dtype)
        cp = ContextParallel(dist.group.WORLD)
        t = sum(PACKS[0][1])
        gen = torch.Generator().manual_seed(0)
        inputs = [tuple(torch.randn(t, 64, generator=gen).to("cuda", dtype) for _ in range(2)) for _ in PACKS]
        packs = [PackedSeqs.from_lengths(real, padded, device="cuda") for real, padded in PACKS]
        local = [(cp.shard(x, p), cp.shard(dy, p)) for (x, dy), p in zip(inputs, packs)]
        log.write("capturing\n")
        step = CapturedLayerStep(layer, *local[0], packs[0].cu_seqlens, packs[0].cu_seqlens_padded, MAX_SEQLEN, cp=cp)
        worst, bitwise = 0.0, True
        for i, ((xl, dyl), packed) in enumerate(zip(local, packs)):
            log.write(f"replay {i}\n")
            step.replay(xl, dyl, packed.cu_seqlens, packed.cu_seqlens_padded)
            torch.cuda.synchronize()
            log.write(f"eager {i}\n")
            got = {"y": step.y.clone(), "x": step.x_grad.clone(), **{n: g.clone() for n, g in step.grads.items()}}
            layer.zero_grad(set_to_none=True)
            x = xl.detach().clone().requires_grad_()
            static = CaptureSafePackedSeqs(packed.cu_seqlens, packed.cu_seqlens_padded, num_rows=t,
                                           max_seqlen=MAX_SEQLEN)
            y = layer(x, packed=static, cp=cp)
            y.backward(dyl)
            eager = {"y": y.detach(), "x": x.grad, **{n: g for n, g in grads(layer).items() if g is not None}}
            assert got.keys() == eager.keys(), (sorted(got), sorted(eager))
            worst = max(worst, *(rel_err(got[n], eager[n]) for n in eager))
            bitwise &= all(torch.equal(got[n], eager[n]) for n in eager)
        out.put((rank, "ok", (worst, bitwise)))
        dist.destroy_process_group()
    except Exception:  # report and leave at once: the other rank may be waiting in a collective
        out.put((rank, "error", traceback.format_exc()))
        log.flush()
        os._exit(1)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("layer_type", ["sliding", "csa", "hca"], ids=["W", "CSA", "HCA"])
def test_cp_graph_replay_equals_eager(layer_type, backend, tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    logs = [str(tmp_path / f"rank{r}.log") for r in range(2)]
    procs = [ctx.Process(target=_worker, args=(r, 2, port, layer_type, backend, out, logs[r])) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in procs:
            results.append(out.get(timeout=HANG_S + 60))
    except queue.Empty:
        pass
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    if len(results) < len(procs):
        dumps = "\n".join(f"--- rank {r} ---\n" + open(path).read() for r, path in enumerate(logs)
                          if os.path.exists(path))
        pytest.fail(f"only {len(results)} of {len(procs)} ranks reported: {results}\n{dumps}")
    for rank, status, value in sorted(results):
        assert status == "ok", f"rank {rank}:\n{value}"
        worst, bitwise = value
        if backend == "reference":
            assert bitwise, f"rank {rank}: replay is not bitwise equal to eager (max rel. error {worst:.2e})"
        else:
            assert worst <= 2e-2, f"rank {rank}: replay differs from eager by {worst:.2e}"
