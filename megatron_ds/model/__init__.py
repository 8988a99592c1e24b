"""The GPT as layer specs and torch modules, for `pretrain_gpt.py` and your own training scripts.

    from megatron_ds.model.gpt_pipe import GPTModelPipe, build_layer_specs   # imports DeepSpeed
    from megatron_ds.model.naming import gpt_spec_groups                      # pure: no torch

Import the modules themselves; this file imports nothing, so a pure module of this package
(`naming`, `activations`) never pulls in torch or DeepSpeed through it.
"""
