"""Which FP8 piece moves the gradients: the patched HF FP8 model with PEFT LoRA (as
``lab/probes/fp8_lora_grads.py``) and the csattn FP8-held tiny model (as tests/models/test_fp8_model_gpu.py), each
run with one FP8 piece switched to W8A16 or to the dequantized reference at a time; per variant the loss, the
largest ratio of a gradient's norm to the fp32 / fp64 CPU run's, and the median and largest relative error.
    python -m lab.probes.fp8_toggles"""

import statistics
import tempfile

import torch
from peft import get_peft_model

import csattn.ops.fp8.grouped as grouped
import csattn.ops.fp8.linear as linear
from csattn.integrations.transformers import patch
from csattn.models.deepseek_v4 import DeepseekV4ModelConfig, load_pretrained
from csattn.models.deepseek_v4.release import write_release_checkpoint
from lab.probes.fp8_lora_grads import SHAPE, grads
from tests.integrations import peft_support as ps
from tests.integrations.test_integration_hf_fp8 import _lora, _rel, fp8_pair
from tests.models import test_fp8_model_gpu as native
from tests.models.model_utils import tiny_config_dict

KC = grouped.kernel_compute


def _w8a16(x, compute):
    return KC(x, "w8a16")


VARIANTS = {  # name -> (setup, teardown)
    "fp8": (lambda: None, lambda: None),
    "linear-dgrad-bf16": (lambda: linear.DGRAD.update(fp8="bf16"), lambda: linear.DGRAD.update(fp8="copy")),
    "linear-dgrad-triton": (lambda: linear.DGRAD.update(fp8="triton"), lambda: linear.DGRAD.update(fp8="copy")),
    "linear-w8a16": (lambda: setattr(linear, "kernel_compute", _w8a16), lambda: setattr(linear, "kernel_compute", KC)),
    "grouped-w8a16": (lambda: setattr(grouped, "kernel_compute", _w8a16),
                      lambda: setattr(grouped, "kernel_compute", KC)),
    "no-scaled-mm": (lambda: setattr(linear, "_scaled_mm_ok", lambda a, n: False),
                     lambda: setattr(linear, "_scaled_mm_ok", SCALED_MM_OK)),
}
SCALED_MM_OK = linear._scaled_mm_ok


def summary(name, loss, grads, want_loss, want):
    ratios = [float(grads[n].norm() / g.norm().clamp_min(1e-30)) for n, g in want.items() if n in grads]
    errs = [_rel(grads[n], g) for n, g in want.items() if n in grads]
    print(f"  {name:22s} loss {float(loss):.6f} (exact {float(want_loss):.6f})  max |g|/|exact| {max(ratios):9.2e}  "
          f"rel err median {statistics.median(errs):8.2e} max {max(errs):8.2e}  ({len(errs)} of {len(want)})",
          flush=True)


def hf_probe():
    print("patched HF FP8 model + PEFT LoRA (experts FP8)", flush=True)
    lora = _lora(experts=True)
    exact = get_peft_model(patch(fp8_pair("fp8", intermediate=256, **SHAPE)[1]), lora)
    state = {n: p for n, p in exact.state_dict().items() if ".lora_" in n}
    docs = ps.docs([100, 156], 64, seed=2)
    want_loss, want = grads(exact, "cpu", docs, False)
    held, ref = fp8_pair("fp8", intermediate=256, **SHAPE)
    model = get_peft_model(patch(ref), lora).cuda()
    model.load_state_dict(state, strict=False)
    summary("bf16 (dequantized)", *grads(model, "cuda", docs, True), want_loss, want)
    for name, (on, off) in VARIANTS.items():
        on()
        try:
            model = get_peft_model(patch(fp8_pair("fp8", intermediate=256, **SHAPE)[0], fp8_compute="fp8"),
                                   lora).cuda()
            model.load_state_dict(state, strict=False)
            summary(name, *grads(model, "cuda", docs, True), want_loss, want)
        finally:
            off()


def native_probe():
    print("csattn FP8-held tiny model (all trainable parameters)", flush=True)
    raw = tiny_config_dict("flash", mtp=1)
    raw.update(hidden_size=256, moe_intermediate_size=256, n_routed_experts=8)
    with tempfile.TemporaryDirectory() as tmp:
        write_release_checkpoint(DeepseekV4ModelConfig.from_hf(raw), tmp, seed=5)
        cuda = torch.device("cuda")
        loss, _, want = native.run(load_pretrained(tmp, dtype=torch.float64), torch.device("cpu"))
        want = {n: g.double() for n, g in want.items()}
        got = native.run(load_pretrained(tmp, dtype=torch.bfloat16).to(cuda), cuda)
        summary("bf16 (dequantized)", got[0].cpu(), {n: g.double().cpu() for n, g in got[2].items()}, loss, want)
        for name, (on, off) in VARIANTS.items():
            on()
            try:
                model = load_pretrained(tmp, dtype=torch.bfloat16, base_precision="fp8", fp8_linears=True).to(cuda)
                got = native.run(model, cuda)
                summary(name, got[0].cpu(), {n: g.double().cpu() for n, g in got[2].items()}, loss, want)
            finally:
                off()


if __name__ == "__main__":
    native_probe()
    hf_probe()
