"""An HF ``DeepseekV4ForCausalLM`` held in FP8 as transformers' ``FineGrainedFP8Config`` holds it (``FP8Linear``,
``FP8GroupedLinear``, ``FP8Experts`` with FP8 or MXFP4-packed experts; built with transformers' own
``replace_with_fp8_linear`` and filled with release-format quantized weights, since transformers quantizes only on a
GPU) patched by csattn, with PEFT LoRA: the same loss and every adapter gradient as HF eager + the same PEFT adapters
on the dequantized fp32 copy (the CPU path dequantizes exactly), every adapter gets a gradient through the frozen
FP8 layers, the FP8 codes get none and stay as they are; what csattn's FP8 ops cannot run exactly is refused."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import FineGrainedFP8Config  # noqa: E402
from transformers.integrations.finegrained_fp8 import (  # noqa: E402
    Fp8Dequantize,
    FP8Experts,
    FP8GroupedLinear,
    FP8Linear,
    replace_with_fp8_linear,
)
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer  # noqa: E402

from csattn.integrations.transformers import is_patched, patch, unpatch  # noqa: E402
from csattn.models.deepseek_v4.release import quantize_fp8_blocks, quantize_mxfp4  # noqa: E402
from tests.helpers import emulate_fp8_compute, model_errors, within_references  # noqa: E402
from tests.integrations import peft_support as ps  # noqa: E402
from tests.models.model_utils import hf_model, tiny_config_dict  # noqa: E402

TOL = 1e-4  # fp32
SEED = 3
LENGTHS = [13, 29, 7, 21]
MODULES = ["q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", "gate_proj", "weights_proj", "up_proj", "down_proj"]
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
ORDERS = ["peft_after_patch", "patch_after_peft"]


def _config(intermediate: int = 128, **overrides) -> dict:
    cfg = tiny_config_dict("flash")
    # 2I = 256: the gate and up halves of a fused expert weight are whole 128-row blocks, as in the release
    cfg.update(moe_intermediate_size=intermediate, **overrides)
    return cfg


def _quantized_experts(w: torch.Tensor, expert_dtype: str, halves: int,
                       block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` -> HF's FP8Experts tensors: per expert (per half of a fused gate_up, as the release stores
    w1 / w3), FP8 128 x 128 blocks or MXFP4, scales as ue8m0."""
    codes, scales = [], []
    for matrix in w:
        parts = [quantize_fp8_blocks(h, (block, block)) if expert_dtype == "fp8" else quantize_mxfp4(h)
                 for h in matrix.chunk(halves, 0)]
        codes.append(torch.cat([q for q, _ in parts]))
        scales.append(torch.cat([s.view(torch.uint8) for _, s in parts]).view(torch.float8_e8m0fnu))
    return torch.stack(codes), torch.stack(scales)


def fp8_pair(expert_dtype: str = "fp8", block: int = 128, intermediate: int = 128, **overrides):
    """``(held, ref)``: the HF model held in FP8 (transformers' modules, release-format tensors) and HF's fp32 model
    whose weights are their dequantized values (by transformers' own ``Fp8Dequantize``)."""
    cfg = _config(intermediate, **overrides)
    ref = hf_model(cfg, seed=SEED)
    held = hf_model(cfg, seed=SEED)
    qc = FineGrainedFP8Config(weight_block_size=(block, block), scale_fmt="ue8m0", expert_dtype=expert_dtype)
    skip = FineGrainedFP8HfQuantizer(qc, pre_quantized=True).get_modules_to_not_convert(
        held, qc.modules_to_not_convert, held._keep_in_fp32_modules)
    replace_with_fp8_linear(held, modules_to_not_convert=skip, quantization_config=qc, pre_quantized=True)
    dequant = Fp8Dequantize(None)._dequantize_one
    tensors, exact = {}, {}
    for name, module in held.named_modules():
        if isinstance(module, FP8Linear):
            q, s = quantize_fp8_blocks(ref.get_parameter(f"{name}.weight").detach(), (block, block))
            tensors.update({f"{name}.weight": q, f"{name}.weight_scale_inv": s})
            exact[f"{name}.weight"] = dequant(q, s, torch.float32)
        elif isinstance(module, FP8Experts):
            for param, halves in (("gate_up_proj", 2), ("down_proj", 1)):
                q, s = _quantized_experts(ref.get_parameter(f"{name}.{param}").detach(), expert_dtype, halves, block)
                tensors.update({f"{name}.{param}": q, f"{name}.{param}_scale_inv": s})
                exact[f"{name}.{param}"] = torch.stack([dequant(a, b, torch.float32) for a, b in zip(q, s)])
    held.load_state_dict(tensors, strict=False, assign=True)
    ref.load_state_dict(exact, strict=False)
    assert not any(p.is_meta for p in held.parameters())
    return held, ref


def _lora(experts: bool = True, **kwargs) -> LoraConfig:
    # init_lora_weights=False: lora_B random too, so the adapters change the forward and every factor gets a gradient
    params = ["o_a_proj.weight"] + (EXPERTS if experts else [])
    return LoraConfig(**{**dict(r=4, lora_alpha=8, target_modules=MODULES, target_parameters=params,
                                init_lora_weights=False), **kwargs})


def _codes(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items() if t.element_size() == 1}


@pytest.mark.parametrize("expert_dtype", ["fp8", "fp4"])
@pytest.mark.parametrize("order", ORDERS)
def test_fp8_model_with_lora_equals_hf_eager_on_the_dequantized_weights(expert_dtype, order, assert_close):
    held, ref = fp8_pair(expert_dtype)
    kinds = {type(m) for m in held.modules()}
    assert {FP8Linear, FP8GroupedLinear} <= kinds and any(issubclass(k, FP8Experts) for k in kinds)
    lora = _lora(experts=expert_dtype == "fp8")  # PEFT cannot size LoRA on packed FP4 experts (refused below)
    ref = get_peft_model(ref, lora)
    if order == "peft_after_patch":
        ours = get_peft_model(patch(held), lora)
    else:
        ours = patch(get_peft_model(held, lora))
    assert is_patched(ours)
    swapped = {type(m).__name__ for m in ours.modules()}
    assert {"PatchedFP8Linear", "PatchedFP8GroupedLinear", "PatchedFP8Experts"} <= swapped  # csattn's FP8 ops run
    ours.load_state_dict({n: p for n, p in ref.state_dict().items() if ".lora_" in n}, strict=False)
    codes = _codes(ours)
    checked = ps.matches_hf_eager(ours, ref, ps.docs(LENGTHS, _config()["vocab_size"]), assert_close, TOL)
    # 4 layers: q_a, q_b, kv, o_a, o_b, shared gate / up / down (8 x 2 factors), the experts' two tensors (2 x 2) on
    # FP8 experts; the compressors' kv / gate (2 x 2) on the two compressed layers
    assert checked == 4 * (16 + (4 if expert_dtype == "fp8" else 0)) + 2 * 4
    for name, t in _codes(ours).items():
        assert torch.equal(t.view(torch.uint8), codes[name].view(torch.uint8)), name  # frozen, untouched
    assert all(p.grad is None for n, p in ours.named_parameters() if p.element_size() == 1)


@pytest.mark.parametrize("expert_dtype", ["fp8", "fp4"])
def test_fp8_model_under_autocast_equals_the_dequantized_model(expert_dtype):
    """Under ``torch.autocast`` (bf16, ``Trainer(bf16=True)``) the FP8-held model computes on the weights the
    dequantized fp32 model casts to bf16 (its FP8 scales never cast): on the CPU the loss and every adapter
    gradient are bit for bit the dequantized model's, patched the same way."""
    held, ref = fp8_pair(expert_dtype)
    lora = _lora(experts=expert_dtype == "fp8")
    ours, theirs = get_peft_model(patch(held), lora), get_peft_model(patch(ref), lora)
    theirs.load_state_dict({n: p for n, p in ours.state_dict().items() if ".lora_" in n}, strict=False)
    docs = ps.docs(LENGTHS, _config()["vocab_size"])
    losses = []
    for model in (ours, theirs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(ps.flattened_loss(model, docs))
        losses[-1].backward()
    assert losses[0].dtype == torch.float32 and torch.equal(losses[0], losses[1])
    want = ps.adapters(theirs)
    for name, p in ps.adapters(ours).items():
        assert (p.grad is None) == (want[name].grad is None), name
        assert p.grad is None or torch.equal(p.grad, want[name].grad), name


def test_every_adapter_trains_through_the_frozen_fp8_layers():
    """With csattn's indexer loss the indexer's adapters (its q_b_proj held in FP8 and read as a weight) train too:
    every adapter tensor gets a nonzero gradient, none silently dropped."""
    held, _ = fp8_pair("fp8")
    model = get_peft_model(patch(held, indexer_loss_coeff=1.0), _lora())
    ps.flattened_loss(model, ps.docs(LENGTHS, _config()["vocab_size"])).backward()
    adapters = ps.adapters(model)
    assert len(adapters) == 4 * 20 + 2 * 4 + 8
    missing = [n for n, p in adapters.items() if p.grad is None or torch.count_nonzero(p.grad) == 0]
    assert not missing, missing


def test_unpatch_gives_back_hf_fp8_modules():
    held, _ = fp8_pair("fp4")
    before = {n: type(m) for n, m in held.named_modules()}
    state = _codes(held)
    unpatch(patch(held))
    assert {n: type(m) for n, m in held.named_modules()} == before
    assert set(_codes(held)) == set(state)  # the MXFP4 copies converted for csattn are gone again
    assert not any(n.startswith("csattn_") or ".csattn_" in n for n, _ in held.named_buffers())


def test_lora_on_fp4_experts_refused():
    held, _ = fp8_pair("fp4")
    model = get_peft_model(patch(held), _lora(target_modules=["q_a_proj"], target_parameters=EXPERTS))
    ids = torch.randint(0, _config()["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.(gate_up|down)_proj: PEFT sized the "
                                         r"adapter 'default'.*FP4"):
        model(input_ids=ids)


def test_inexact_mxfp4_experts_refused():
    """A 128 x 128 block whose MXFP4 group scales lie too far apart for one FP8 block scale: refused by name."""
    held, _ = fp8_pair("fp4")
    experts = held.model.layers[1].mlp.experts
    with torch.no_grad():
        scale = experts.down_proj_scale_inv.view(torch.uint8)
        scale[0, 0, 0] = 127 + 30  # one group 2**30 times larger than its block's others
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj: expert 0's 128 x 128 block"):
        patch(held)
    assert not is_patched(held)
    assert type(held.model.layers[0].self_attn.q_a_proj) is FP8Linear  # nothing changed


def test_other_block_sizes_refused():
    held, _ = fp8_pair("fp8", block=16)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_a_proj: weight_block_size \(16, 16\).*"
                                         r"dequantize=True"):
        patch(held)
    assert not is_patched(held)


def test_scales_csattn_cannot_hold_refused():
    """A gate and an up half with their own scales inside one 128-row block (2I < 256), a ue8m0 NaN scale byte."""
    held, _ = fp8_pair("fp8", intermediate=16)
    scale = held.model.layers[0].mlp.experts.gate_up_proj_scale_inv  # [E, 2, 1]: the gate's row, the up's row
    with torch.no_grad():
        scale.view(torch.uint8)[:, 1] = scale.view(torch.uint8)[:, 0] + 1  # the up half's scale twice the gate's
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj: the gate and up halves"):
        patch(held)
    assert not is_patched(held) and type(held.model.layers[0].self_attn.q_a_proj) is FP8Linear
    held, _ = fp8_pair("fp8")
    with torch.no_grad():
        held.model.layers[3].self_attn.o_b_proj.weight_scale_inv.view(torch.uint8).fill_(255)
    with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn\.o_b_proj\.weight.*byte 255"):
        patch(held)
    assert not is_patched(held) and type(held.model.layers[0].self_attn.q_a_proj) is FP8Linear


@pytest.mark.parametrize("expert_dtype", ["fp8", "fp4"])
def test_to_dtype_keeps_the_codes_and_the_model_computes_in_it(expert_dtype, assert_close):
    """``model.to(torch.bfloat16)`` after ``patch``: the FP8 codes and scales (and converted MXFP4 copies) keep their
    bytes, the compute dtype follows (the read weights dequantize in bf16), and the model equals the dequantized
    model cast to bf16, patched the same way."""
    held, ref = fp8_pair(expert_dtype)
    patch(held)
    before = {n: t.clone() for n, t in [*held.named_parameters(), *held.named_buffers()] if t.element_size() == 1}
    scales = {n: t.clone() for n, t in held.named_parameters() if n.endswith("_scale_inv")}
    held.to(torch.bfloat16)
    now = dict([*held.named_parameters(), *held.named_buffers()])
    for name, t in [*before.items(), *scales.items()]:
        assert now[name].dtype == t.dtype and torch.equal(now[name].view(torch.uint8), t.view(torch.uint8)), name
    attn = held.model.layers[2].self_attn
    assert attn.compute_dtype() == torch.bfloat16 and attn.projection("q_b_proj").weight.dtype == torch.bfloat16
    ids = ps.docs([30], _config()["vocab_size"], seed=4)[0][None]
    with torch.no_grad():
        got = held(input_ids=ids).logits
        want = patch(ref.to(torch.bfloat16))(input_ids=ids).logits
    assert got.dtype == torch.bfloat16
    assert_close(got.float(), want.float(), 0.0, "bf16 logits")


def test_grouped_o_a_proj_called_as_hf_calls_it(assert_close):
    """The patched ``FP8GroupedLinear`` (whose weight the attention reads) also runs HF's grouped contract when
    called: ``[..., G, K]`` -> ``[..., G, N / G]``, as HF's ``DeepseekV4GroupedLinear`` on the dequantized weight."""
    held, ref = fp8_pair("fp8")
    patch(held)
    ours, theirs = held.model.layers[1].self_attn.o_a_proj, ref.model.layers[1].self_attn.o_a_proj
    x = torch.randn(2, 5, theirs.n_groups, theirs.in_features, generator=torch.Generator().manual_seed(1))
    assert_close(ours(x), theirs(x), 1e-6, "o_a_proj")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.gpu
@pytest.mark.parametrize("compute", ["fp8", "w8a16"])
@pytest.mark.parametrize("expert_dtype", ["fp8", "fp4"])
def test_fp8_model_on_the_gpu_trains_like_the_dequantized_one(expert_dtype, compute, monkeypatch):
    """On the GPU, under bf16 autocast, the FP8 kernels (``fp8_linear``, the grouped FP8 GEMMs with LoRA per
    expert): loss and adapter gradients against the fp32 CPU run within twice the dequantized model's error in
    bf16, plus for ``"fp8"`` the FP8 recipe's own (the FP8 model on the CPU with the ops' references quantizing as
    the kernels do: :func:`tests.helpers.emulate_fp8_compute`); every adapter that trains on the CPU trains here."""
    shape = dict(hidden_size=256, n_routed_experts=8, index_topk=64)  # the top-k holds every compressed entry
    lora = _lora(experts=expert_dtype == "fp8")
    exact = get_peft_model(patch(fp8_pair(expert_dtype, intermediate=256, **shape)[1]), lora)
    state = {n: p for n, p in exact.state_dict().items() if ".lora_" in n}
    docs = ps.docs([100, 156], 64, seed=2)

    def grads(model, device):
        model.load_state_dict(state, strict=False)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = ps.flattened_loss(model, docs, device)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in ps.adapters(model).items()}

    want_loss, want = grads(exact, "cpu")

    def errors(model, device):
        return model_errors(*grads(model, device), want_loss, want)

    refs = [errors(get_peft_model(patch(fp8_pair(expert_dtype, intermediate=256, **shape)[1]), lora).cuda(), "cuda")]
    if compute == "fp8":
        with monkeypatch.context() as m:
            emulate_fp8_compute(m)
            held = fp8_pair(expert_dtype, intermediate=256, **shape)[0]
            refs.append(errors(get_peft_model(patch(held, fp8_compute="fp8"), lora), "cpu"))
    held = fp8_pair(expert_dtype, intermediate=256, **shape)[0]
    got = errors(get_peft_model(patch(held, fp8_compute=compute), lora).cuda(), "cuda")
    print(expert_dtype, compute, {k: f"{v:.2e}" for k, v in got.items()}, "references", refs)
    bad = within_references(got, *refs)
    assert not bad, bad
