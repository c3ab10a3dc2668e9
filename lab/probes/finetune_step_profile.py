"""Where a fine-tuning step of the V4-Flash slice spends its time, by kernel, for the modes of
``benchmarks.finetune`` (16k tokens, one profiled step after one warm-up). Needs the slice's checkpoint (written by
``benchmarks.finetune --parts write``). Run on an H200:

    python -m lab.probes.finetune_step_profile --ckpt /tmp/csattn_v4_flash_slice --modes a,d
"""

import argparse
import gc

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.finetune import MODES, load_base, prepare
from csattn.report.model import proxy_batch, proxy_lengths

GROUPS = (  # kernel-name fragments -> a coarse group, first match wins
    ("fp8 grouped (gluon)", ("fp8_grouped",)),
    ("LoRA kernels (experts, Triton)", ("_rank_in", "_rank_grad", "_low_rank_add")),
    ("grouped mm (bf16)", ("GroupProblem", "grouped", "Grouped")),  # torch's grouped_mm: CUTLASS's GroupProblem
    ("scaled mm (fp8 cuBLAS)", ("sm90_xmma_gemm_e4m3", "e4m3", "fp8")),
    ("gemm (bf16 cuBLAS)", ("nvjet", "gemm", "Gemm", "xmma", "cutlass")),
    ("sparse / window attention", ("attn", "attention", "sparse", "flash")),
    ("indexer", ("index", "topk")),
    ("optimizer", ("adam", "Adam", "sgd", "multi_tensor", "foreach")),
    ("copies / casts", ("copy", "Copy", "cast", "convert")),
    ("elementwise / reduce", ("elementwise", "reduce", "Reduce", "vectorized")),
)


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other"


def one(base, name: str, tokens: int, rank: int) -> None:
    device = torch.device("cuda")
    mode = MODES[name]
    model = prepare(base, mode, device, rank)
    ids, packed, labels = proxy_batch(proxy_lengths(tokens), model.config.vocab_size, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-5, fused=True) if mode.optimizer == "sgd" else \
        torch.optim.AdamW(params, lr=1e-5, fused=True)

    def step() -> None:
        model(ids, packed=packed, labels=labels, return_logits=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events) / 1e3
    groups: dict[str, float] = {}
    for e in events:
        groups[group_of(e.key)] = groups.get(group_of(e.key), 0.0) + e.device_time_total / 1e3
    print(f"== ({name}) {mode.what}, {tokens} tokens: {total:.1f} ms of kernels")
    for g, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {ms:8.2f} ms  {g}")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:40]:
        print(f"  {e.device_time_total / 1e3:8.2f} ms x{e.count:<4d} {e.key[:120]}")
    gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--modes", default="a,d")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--lora-rank", type=int, default=16)
    args = ap.parse_args()
    base, _ = load_base(args.ckpt, "cuda")
    for name in args.modes.split(","):
        one(base, name, args.tokens, args.lora_rank)
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
