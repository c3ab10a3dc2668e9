"""One training step (forward + backward) of the model proxy at one length, timed once, with its allocator peak:
for lengths where a benchmark's repeated calls cost too much device time (512k tokens: ~50 s a step).

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m benchmarks.model_long_step --tokens 524288 \\
        --recompute full+offload

``--recompute`` takes the model benchmark's values (a choice, optionally ``+offload``). Prints one line:
the step's seconds (the first step: it includes kernel compilation), the peak GiB and the loss.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.providers.model import _batch, proxy_config
from csattn.report.model import proxy_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=524288)
    p.add_argument("--recompute", default="full+offload")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk-experts", type=int, default=2)
    p.add_argument("--json", help="also write the record here")
    a = p.parse_args()
    shape = dict(tokens=a.tokens, docs="ragged", experts=a.experts, topk_experts=a.topk_experts, layers=4,
                 recompute=a.recompute, seed=0)
    device = torch.device("cuda")
    cfg = proxy_config(shape)
    model = proxy_model(cfg, torch.bfloat16, device, 0)
    lengths, ids, packed, labels = _batch(shape, cfg.vocab_size, device)
    weights = torch.cuda.memory_allocated() / 2**30
    rec = {"tokens": a.tokens, "docs": lengths, "recompute": a.recompute, "weights_gib": weights}
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(ids, packed=packed, labels=labels, return_logits=False)
        out.loss.backward()
        torch.cuda.synchronize()
        rec.update(seconds=time.perf_counter() - t0, peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                   loss=float(out.loss.detach()))
    except torch.OutOfMemoryError as e:
        rec.update(error="out of memory", detail=str(e)[:300], peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    print(json.dumps(rec))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
