"""The GPT pipeline model, for `pretrain_gpt.py` and for your own training scripts.

    from megatron_ds.model import GPTModelPipe, build_layer_specs, gpt_spec_groups

`GPTModelPipe` and `build_layer_specs` import DeepSpeed, so they are loaded on first use.
"""

from __future__ import annotations

from typing import Any

from megatron_ds.model.naming import gpt_spec_groups, gpt_spec_param_counts

__all__ = [
    "GPTModelPipe",
    "build_layer_specs",
    "build_topology",
    "gpt_spec_groups",
    "gpt_spec_param_counts",
    "spec_name",
]


def __getattr__(name: str) -> Any:
    if name in ("GPTModelPipe", "build_layer_specs", "build_topology", "spec_name"):
        from megatron_ds.model import gpt_pipe

        return getattr(gpt_pipe, name)
    raise AttributeError(name)
