"""Which FP8 path moves the adapter gradients of the patched HF FP8 model (tests/integrations/test_integration_hf_fp8.py
``test_fp8_model_on_the_gpu_trains_like_the_dequantized_one``): the norms of every gradient and their relative error
against the fp32 CPU run, for FP8 compute through the Gluon kernel, FP8 compute without it (Triton forward, W8A16
input gradient), W8A16, and the dequantized model in bf16.   python -m lab.probes.fp8_lora_grads [fp8|fp4]"""

import sys

import torch
from peft import get_peft_model

import csattn.ops.fp8.grouped as grouped
from csattn.integrations.transformers import patch
from tests.integrations import peft_support as ps
from tests.integrations.test_integration_hf_fp8 import _lora, _rel, fp8_pair

SHAPE = dict(hidden_size=256, n_routed_experts=8, index_topk=64)


def grads(model, device, docs, autocast):
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        loss = ps.flattened_loss(model, docs, device)
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.detach().double().cpu() for n, p in ps.adapters(model).items()
                                  if p.grad is not None}


def main(expert_dtype: str = "fp8") -> None:
    lora = _lora(experts=expert_dtype == "fp8")
    exact = get_peft_model(patch(fp8_pair(expert_dtype, intermediate=256, **SHAPE)[1]), lora)
    state = {n: p for n, p in exact.state_dict().items() if ".lora_" in n}
    docs = ps.docs([100, 156], 64, seed=2)
    want_loss, want = grads(exact, "cpu", docs, False)
    rows = {}
    gluon_fits = grouped.gluon_fits
    for name, compute, gluon in [("fp8", "fp8", True), ("fp8-triton", "fp8", False), ("w8a16", "w8a16", True),
                                 ("bf16", None, True)]:
        grouped.gluon_fits = gluon_fits if gluon else (lambda a, w: False)
        held, ref = fp8_pair(expert_dtype, intermediate=256, **SHAPE)
        model = get_peft_model(patch(ref) if compute is None else patch(held, fp8_compute=compute), lora).cuda()
        model.load_state_dict(state, strict=False)
        rows[name] = grads(model, "cuda", docs, True)
    grouped.gluon_fits = gluon_fits
    print(f"loss exact {float(want_loss):.6f} " + " ".join(f"{k} {float(v[0]):.6f}" for k, v in rows.items()))
    print(f"{'adapter':70s} {'|exact|':>9s} " + " ".join(f"{k:>18s}" for k in rows))
    for n, g in want.items():
        nan = float("nan")
        cells = [f"{float(r[1][n].norm()) if n in r[1] else nan:9.2e}/{_rel(r[1][n], g) if n in r[1] else nan:8.2e}"
                 for r in rows.values()]
        print(f"{n[-70:]:70s} {float(g.norm()):9.2e} " + " ".join(f"{c:>18s}" for c in cells))


if __name__ == "__main__":
    main(*sys.argv[1:])
