"""FP8-held frozen weights on the GPU: the tiny release-format model with its experts (and dense linears) held in
FP8, moved with ``.to("cuda")``, runs the FP8 kernels (``"fp8"``: FP8 tensor cores; ``"w8a16"``: bf16 MMA on FP8
storage) and trains like the model with the dequantized weights: its loss, logits and trainable gradients are as
close to the fp64 reference as the bf16 model's, up to the activation quantization of ``"fp8"``."""

import pytest
import torch

from csattn.models.deepseek_v4 import DeepseekV4ModelConfig, load_pretrained
from csattn.models.deepseek_v4.quant import Fp8Experts
from csattn.models.deepseek_v4.release import write_release_checkpoint
from csattn.packing import PackedSeqs
from tests.helpers import emulate_fp8_compute, model_errors, within_references
from tests.models.model_utils import tiny_config_dict

pytestmark = pytest.mark.gpu


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def run(model, device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (256,), generator=g).to(device)
    packed = PackedSeqs.from_lengths([100, 156], device=device)
    out = model(ids, packed=packed, labels=torch.roll(ids, -1))
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), out.logits.detach(), grads


@pytest.mark.parametrize("compute", ["fp8", "w8a16"])
def test_fp8_held_model_trains_like_the_dequantized_one(tmp_path, compute, monkeypatch):
    """Loss, logits and gradients against the fp64 CPU run: w8a16 within twice the bf16 model's error (it computes
    what that model computes); fp8 within twice the bf16 model's error plus the FP8 recipe's own, which the same
    model on the CPU in fp32 shows with the FP8 ops' references quantizing as the kernels do
    (:func:`tests.helpers.emulate_fp8_compute`)."""
    raw = tiny_config_dict("flash", mtp=1)
    raw.update(hidden_size=256, moe_intermediate_size=256, n_routed_experts=8)
    write_release_checkpoint(DeepseekV4ModelConfig.from_hf(raw), str(tmp_path), seed=5)
    device, cpu = torch.device("cuda"), torch.device("cpu")
    exact = run(load_pretrained(str(tmp_path), dtype=torch.float64), cpu)  # the CPU references

    def errors(result):  # over the run's trainable parameters (the FP8-held linears are frozen)
        return model_errors(result[0], result[2], exact[0], {n: exact[2][n] for n in result[2]}, result[1], exact[1])

    refs = [errors(run(load_pretrained(str(tmp_path), dtype=torch.bfloat16).to(device), device))]
    if compute == "fp8":
        with monkeypatch.context() as m:
            emulate_fp8_compute(m)
            held = load_pretrained(str(tmp_path), dtype=torch.float32, base_precision="fp8", fp8_linears=True)
            refs.append(errors(run(held, cpu)))
    model = load_pretrained(str(tmp_path), dtype=torch.bfloat16, base_precision=compute, fp8_linears=True).to(device)
    experts = model.model.layers[2].mlp.experts
    assert isinstance(experts, Fp8Experts) and experts.gate_up_proj.is_cuda
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.gate_up_proj_scale_inv.is_cuda
    got = errors(run(model, device))
    print(compute, {k: f"{v:.2e}" for k, v in got.items()}, "references", refs)
    bad = within_references(got, *refs)
    assert not bad, bad


def test_conversion_on_the_gpu_equals_the_hosts(tmp_path):
    """MXFP4 -> FP8 and the dequantizers run on the GPU bit for bit as on the host, and a load converting there
    (``convert_device``, what ``load_hf_sharded`` passes) holds the same bytes."""
    from csattn.models.deepseek_v4.quant import dequantize_fp8, dequantize_mxfp4, mxfp4_to_fp8

    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 256, 96), dtype=torch.uint8, generator=g)
    scale = torch.randint(110, 140, (3, 256, 6), dtype=torch.uint8, generator=g)
    host = mxfp4_to_fp8(packed, scale)
    gpu = mxfp4_to_fp8(packed.cuda(), scale.cuda())
    for a, b in zip(host, gpu):
        assert b.is_cuda and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                         (b.view(torch.uint8) if b.element_size() == 1 else b).cpu())
    assert torch.equal(dequantize_mxfp4(packed, scale), dequantize_mxfp4(packed.cuda(), scale.cuda()).cpu())
    assert torch.equal(dequantize_fp8(host[0], host[1], (128, 128)),
                       dequantize_fp8(gpu[0], gpu[1], (128, 128)).cpu())
    raw = tiny_config_dict("flash", mtp=1)
    raw.update(hidden_size=64, moe_intermediate_size=128, n_routed_experts=8)
    write_release_checkpoint(DeepseekV4ModelConfig.from_hf(raw), str(tmp_path), seed=3)
    for precision in ("fp8", "bf16"):
        want = load_pretrained(str(tmp_path), base_precision=precision).state_dict()
        got = load_pretrained(str(tmp_path), base_precision=precision, convert_device="cuda").state_dict()
        for k, v in want.items():
            assert torch.equal(v.view(torch.uint8), got[k].view(torch.uint8)), k
