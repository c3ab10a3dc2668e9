"""What one training forward of the DeepSeek-V4 model keeps for its backward, per token per layer and per
component, against the bounds its design states (csattn/ops/mhc/README.md, csattn/ops/moe/README.md):

- each block's two combines: the two new stream sets ``2 * n * D`` elements (the next site's input);
- each mHC site with its RMSNorm (one fused op): fp32 logits ``(2+n) n``, the site's and the norm's rstd, and its
  outputs ``post [n]`` / ``comb [n, n]``; not the collapsed input of the norm (recomputed in its backward), not the
  normed block input (rebuilt from the streams for its consumers' backward), no fp32 ``[n * D]`` copy;
- the first block's streams: not kept (copied again from the embedding ``[D]``, which is kept instead);
- the RMSNorm modules themselves: nothing (the sites apply them);
- the MoE: the routed experts' gate/up products ``k * 2I``, the shared expert's ``2I``, per pick a routing weight
  and two int64 indices, and the router's ``[E]`` rows (a few fp32 tensors).

Counted with ``torch.autograd.graph.saved_tensors_hooks`` (every saved storage once, parameters left out) and with
the storages still alive after the forward (``csattn.report.live_tensors``), on the fused mHC kernels (Triton
interpreter) and the grouped MoE; the attention keeps what its own tests bound (tests/layers/test_core.py,
tests/layers/test_memory_bounds.py).
"""

import pytest
import torch

from csattn import PackedSeqs
from csattn.models.deepseek_v4 import DeepseekV4ForCausalLM
from csattn.models.deepseek_v4.model import future_tokens
from csattn.report.live_tensors import model_kept
from csattn.report.model import proxy_config, proxy_lengths


def _model():
    cfg = proxy_config("tiny", backend="reference")
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).to_training_dtype(torch.bfloat16)
    for mod in model.modules():  # the fused mHC kernels (interpreter) and the grouped MoE; attention reference
        if type(mod).__name__ in ("HyperConnection", "HyperHead"):
            mod.backend = "triton"
        elif type(mod).__name__ in ("Experts", "SharedExpert"):
            mod.backend = "grouped"
    return cfg, model


@pytest.mark.slow  # the whole model, every component measured
def test_model_keeps_what_its_design_states():
    cfg, model = _model()
    T = 128
    packed = PackedSeqs.from_lengths(proxy_lengths(T))
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(0))
    labels = future_tokens(ids, packed, 1)[0]
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in own:
            saved[s.data_ptr()] = s.nbytes()
        return t

    def forward():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return model(ids, packed=packed, labels=labels, return_logits=False).loss

    kept, loss = model_kept(model, forward)
    loss.backward()

    n, D, I, k, E, b = cfg.hc_mult, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, \
        cfg.n_routed_experts, 2  # bf16 streams and activations
    bounds = {  # bytes per token, per component of one layer
        "": 2 * n * D * b,  # the block's combines
        "attn_hc": ((2 + n) * n + 2 + n + n * n) * 4,
        "ffn_hc": ((2 + n) * n + 2 + n + n * n) * 4,
        "input_layernorm": 0,
        "post_attention_layernorm": 0,
        "mlp": (k + 1) * 2 * I * b + k * (b + 16) + 8 * E * 4,
    }
    fixed = 4096  # bytes a component may keep whatever T is (per-expert offsets, scalars)
    per_layer = sum(bounds.values())
    attn = 0.0
    for i in range(cfg.num_hidden_layers):
        for part, bound in bounds.items():
            name = f"model.layers.{i}" + (f".{part}" if part else "")
            assert kept.get(name, 0) <= bound * T + fixed, (name, kept.get(name, 0) / T, bound)
        attn = max(attn, kept.get(f"model.layers.{i}.self_attn", 0))
    # the whole forward: the layers' stated parts, the widest attention layer, the embedding (not its n streams) and
    # the head (hyper-head site with the final norm: its normed output, logits and two scales) once
    assert kept.get("model.embed_tokens", 0) <= D * b * T + fixed
    assert kept.get("", 0) <= fixed, "the expanded embedding streams are rebuilt, not kept"
    head = D * b + (D * b + (n + 2) * 4)
    total = cfg.num_hidden_layers * ((per_layer * T + fixed * len(bounds)) + attn) + head * T + 3 * fixed
    assert sum(kept.values()) <= total, (sum(kept.values()) / T, total / T)
    assert sum(saved.values()) <= total, (sum(saved.values()) / T, total / T)
    # nothing like the reference mHC's fp32 [n * D] copies: the layers keep under 8 stream rows a token
    assert sum(kept.values()) / T / cfg.num_hidden_layers < 8 * n * D * b
