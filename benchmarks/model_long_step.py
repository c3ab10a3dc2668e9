"""Training steps (forward + backward) of the model proxy at one long length, each timed alone, with the allocator
peak: for lengths where the benchmark runner's repeated calls cost too much device time (512k tokens: tens of
seconds a step).

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m benchmarks.model_long_step --tokens 524288 \\
        --recompute full+offload --steps 2 --json model_512k.json

``--recompute`` takes the model benchmark's values (a choice, optionally ``+offload``). The first step includes
kernel compilation, so the record's ``ms`` is the last step's. The JSON has the runner's layout (``meta`` and one
``results`` record with ms, tokens/s, TFLOP/s, MFU and the peak GiB beyond the weights), so the results page reads
it like the runner's files.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.providers.model import _batch, proxy_config
from benchmarks.run import run_meta
from csattn.models.deepseek_v4.flops import model_flops
from csattn.report.model import PEAK_TFLOPS, proxy_model


def long_step_record(tokens: int, recompute: str, experts: int, topk: int, steps: int) -> dict:
    """One runner-style record: ``steps`` steps of the proxy on CUDA, the last one's ms, the peak over all of them."""
    shape = dict(tokens=tokens, docs="ragged", experts=experts, topk_experts=topk, layers=4, recompute=recompute,
                 seed=0)
    device = torch.device("cuda")
    cfg = proxy_config(shape)
    model = proxy_model(cfg, torch.bfloat16, device, 0)
    lengths, ids, packed, labels = _batch(shape, cfg.vocab_size, device)
    weights = torch.cuda.memory_allocated(device)
    rec = {"op": "model", "provider": "csattn", "variant": "", "shape": shape, "dtype": "bf16", "mode": "fwdbwd",
           "info": {"tokens": tokens, "docs": lengths, "recompute": recompute, "steps_ms": []}}
    try:
        for _ in range(steps):
            for p in model.parameters():
                p.grad = None
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            model(ids, packed=packed, labels=labels, return_logits=False).loss.backward()
            torch.cuda.synchronize(device)
            rec["info"]["steps_ms"].append((time.perf_counter() - t0) * 1e3)
    except torch.OutOfMemoryError as e:
        rec["error"] = f"out of memory: {str(e)[:200]}"
        return rec
    ms = rec["info"]["steps_ms"][-1]
    flops = model_flops(cfg, [0, *torch.tensor(lengths).cumsum(0).tolist()])
    tflops = (flops["fwd"] + flops["bwd"]) / ms / 1e9
    rec.update(ms=ms, tflops=tflops, mfu=tflops / PEAK_TFLOPS, tokens_per_s=tokens / ms * 1e3,
               peak_gib=(torch.cuda.max_memory_allocated(device) - weights) / 2**30,
               peak_total_gib=torch.cuda.max_memory_allocated(device) / 2**30)
    return rec


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=524288)
    p.add_argument("--recompute", default="full+offload")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk-experts", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="steps, each timed; the record keeps the last")
    p.add_argument("--commit", default=None, help="recorded commit (default: git rev-parse)")
    p.add_argument("--json", help="also write the record here")
    a = p.parse_args(argv)
    rec = long_step_record(a.tokens, a.recompute, a.experts, a.topk_experts, a.steps)
    print(json.dumps(rec))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": run_meta(torch.device("cuda"), a.commit), "results": [rec]}, f, indent=1)


if __name__ == "__main__":
    main()
