"""Every ```python block of README.md runs as written (CPU, small sizes), each in a fresh namespace, so a
reader can copy any one of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_readme_has_the_snippets():
    assert len(BLOCKS) >= 3  # Use, Context parallelism, CUDA graphs (a lost fence would skip them silently)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index):
    code = BLOCKS[index]
    try:
        with torch.random.fork_rng():  # the snippets seed torch; leave the suite's RNG as it was
            exec(compile(code, f"README.md python block {index + 1}", "exec"), {"__name__": "__readme__"})
    finally:
        if dist.is_initialized():  # a snippet that failed before its own destroy_process_group
            dist.destroy_process_group()


def test_readme_hf_example_equals_hf_eager_per_document():
    """The README's claim for its own Trainer example: the patched model on a flattened batch equals HF eager run
    one document at a time, logits and every gradient to 1e-4 in fp32, with the documents of the example (one of
    300 tokens). Its config has enough indexer heads that no two compressed entries tie exactly in the top-k (with
    4 heads many scores are exactly 0, and HF's ``torch.topk`` breaks such ties otherwise than csattn's lower-id
    rule: 8e-2 apart at 300 tokens)."""
    pytest.importorskip("transformers")
    from transformers import DataCollatorWithFlattening, DeepseekV4Config, DeepseekV4ForCausalLM

    from csattn.integrations.transformers import patch
    from tests.helpers import rel_err
    from tests.models.model_utils import randomize_model_

    block = next(b for b in BLOCKS if "patch(DeepseekV4ForCausalLM(config))" in b)
    config_src = re.search(r"^config = (DeepseekV4Config\(.*?\))$", block, flags=re.S | re.M).group(1)
    lengths = [int(n) for n in re.search(r"for n in \(([\d, ]+)\)", block).group(1).split(",")]
    assert max(lengths) >= 300
    config = eval(config_src, {"DeepseekV4Config": DeepseekV4Config})
    config._attn_implementation = config._experts_implementation = "eager"
    torch.manual_seed(0)
    ref = DeepseekV4ForCausalLM(config)
    randomize_model_(ref, 1)  # HF's init leaves gradients that are rounding noise (zero mHC tables and the like)
    ours = patch(DeepseekV4ForCausalLM(config))
    ours.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in lengths]
    batch = DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs])
    batch.pop("labels")
    logits = ours(**batch).logits[0]
    dy = torch.randn(logits.shape, generator=g)
    (logits * dy).sum().backward()
    expected = []
    for doc, d in zip(docs, dy.split(lengths)):
        out = ref(input_ids=doc[None]).logits[0]
        (out * d).sum().backward()
        expected.append(out.detach())
    assert rel_err(logits, torch.cat(expected)) <= 1e-4
    ref_p = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        if ref_p[name].grad is None:  # HF's lightning indexer gets no LM gradient; nor does csattn's here
            assert p.grad is None or not p.grad.any(), name
            continue
        assert rel_err(p.grad, ref_p[name].grad) <= 1e-4, name
