"""fp16 autocast on CUDA: the patched model's gradient error against fp32 HF eager, beside HF eager under the same
autocast, per checked parameter, for the attention / MoE backends and two dy seeds (tests/integrations'
test_autocast_within_twice_hf_autocast_error, spread out)."""
import torch
from transformers import DataCollatorWithFlattening

from csattn.integrations.transformers import patch
from tests.helpers import rel_err
from tests.integrations.test_integration_transformers import LENGTHS, SEED, _docs, _per_document, hf_model
from tests.models.model_utils import tiny_config_dict

KINDS = ("self_attn.q_b_proj.weight", "o_b_proj.weight", "self_attn.kv_proj.weight", "experts.down_proj")
for dtype in (torch.float16, torch.bfloat16):
    for backend, topk in (("auto", 3), ("auto", 8), ("reference", 8)):
        for dy_seed in (1, 2):
            cfg = tiny_config_dict("flash", topk=topk)  # topk 8: every compressed entry (no top-k choice)
            ours, ref = patch(hf_model(cfg, seed=SEED), backend=backend), hf_model(cfg, seed=SEED)
            ref_low = hf_model(cfg, seed=SEED)
            ours, ref, ref_low = ours.cuda(), ref.cuda(), ref_low.cuda()
            docs = [d.cuda() for d in _docs(LENGTHS, cfg["vocab_size"])]
            batch = DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs])
            batch = {k: v.cuda() for k, v in batch.items() if k != "labels"}
            with torch.autocast("cuda", dtype=dtype):
                logits = ours(**batch).logits[0]
            dy = torch.randn(logits.shape, generator=torch.Generator().manual_seed(dy_seed)).cuda()
            (logits.float() * dy).sum().backward()
            expected = torch.cat(_per_document(ref, docs, dy.split(LENGTHS)))
            with torch.autocast("cuda", dtype=dtype):
                hf_low = torch.cat(_per_document(ref_low, docs, dy.split(LENGTHS)))
            ref_p, low_p = dict(ref.named_parameters()), dict(ref_low.named_parameters())
            print(f"== {dtype} backend={backend} topk={topk} dy_seed={dy_seed} logits ours "
                  f"{rel_err(logits.float(), expected):.2e} hf {rel_err(hf_low.float(), expected):.2e}")
            worst = 0.0
            for name, p in ours.named_parameters():
                if name.endswith(KINDS) and p.grad is not None:
                    err, hf_err = rel_err(p.grad, ref_p[name].grad), rel_err(low_p[name].grad.float(), ref_p[name].grad)
                    g = ref_p[name].grad.abs()
                    tiny = float((g[g > 0] < 6.1e-5).float().mean())
                    worst = max(worst, err / hf_err)
                    print(f"  {name:55s} ours {err:.2e} hf {hf_err:.2e} ratio {err / hf_err:.2f} "
                          f"|g| median {float(g.median()):.1e} below fp16 normal {tiny:.2f}")
            print(f"  worst ratio {worst:.2f}")
