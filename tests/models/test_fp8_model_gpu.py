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
def test_fp8_held_model_trains_like_the_dequantized_one(tmp_path, compute):
    raw = tiny_config_dict("flash", mtp=1)
    raw.update(hidden_size=256, moe_intermediate_size=256, n_routed_experts=8)
    write_release_checkpoint(DeepseekV4ModelConfig.from_hf(raw), str(tmp_path), seed=5)
    device = torch.device("cuda")
    exact = run(load_pretrained(str(tmp_path), dtype=torch.float64), torch.device("cpu"))  # the CPU references
    bf16 = run(load_pretrained(str(tmp_path), dtype=torch.bfloat16).to(device), device)
    model = load_pretrained(str(tmp_path), dtype=torch.bfloat16, base_precision=compute, fp8_linears=True).to(device)
    experts = model.model.layers[2].mlp.experts
    assert isinstance(experts, Fp8Experts) and experts.gate_up_proj.is_cuda
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.gate_up_proj_scale_inv.is_cuda
    got = run(model, device)
    errs = {"loss": (rel(got[0], exact[0]), rel(bf16[0], exact[0])),
            "logits": (rel(got[1], exact[1]), rel(bf16[1], exact[1]))}
    for name, g in got[2].items():
        errs[name] = (rel(g, exact[2][name]), rel(bf16[2][name], exact[2][name]))
    print({k: (f"{a:.2e}", f"{b:.2e}") for k, (a, b) in errs.items()})
    # w8a16 computes what the bf16 model computes: within 2x its error (+ a bf16 ulp). fp8 also quantizes the
    # activations per 1x128 tile to e4m3 (3 mantissa bits: ~2**-5 relative RMS per product, which the layers add)
    factor, floor = (2.0, 2**-8) if compute == "w8a16" else (2.0, 2**-3)
    bad = {k: v for k, v in errs.items() if v[0] > factor * v[1] + floor}
    assert not bad, bad
    assert got[2]["model.embed_tokens.weight"].abs().sum() > 0


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
