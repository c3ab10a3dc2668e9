"""Integrations of csattn's kernels into other training stacks.

- :mod:`csattn.integrations.transformers`: ``patch(model)`` makes a Hugging Face ``DeepseekV4ForCausalLM`` run
  csattn's attention, mHC and MoE ops on packed (padding-free) or padded batches, for ``transformers.Trainer``
  and TRL.
- :mod:`csattn.integrations.peft`: PEFT adapters (LoRA on every linear, ``o_a_proj`` and the routed experts) on a
  patched model, in either order; what the patched model cannot honour is refused.
- :mod:`csattn.integrations.hf_fp8`: HF's FP8 modules (``FineGrainedFP8Config``, FP8 or MXFP4 experts) on csattn's
  FP8 ops, frozen, with adapters beside them.

Nothing here is imported by ``import csattn``: each integration imports its framework only when it is imported.
"""
