"""Where each of our tensors lives in a Megatron-LM (megatron-core `GPTModel`) checkpoint, and its row
order there.

Names. torch_dist stores megatron-core's canonical names, the same for the local and the Transformer
Engine layer specs: the input norm as `self_attention.linear_qkv.layer_norm_weight`, the pre-MLP
norm as `mlp.linear_fc1.layer_norm_weight`, every layer tensor once as `decoder.layers.<name>` with
the layers stacked on dim 0. `--ckpt-format torch` stores the model's own `state_dict` names,
`decoder.layers.<i>.<name>`: the local spec's `input_layernorm` / `pre_mlp_layernorm`, or the fused
names under Transformer Engine. Both are tried.

Rows. megatron-core's fused QKV holds, for each key/value group, the group's query heads, then its
key head, then its value head (`[ng, (np/ng + 2) * hn]`), on each tensor rank and therefore in the
joined tensor; ours holds all query heads, then the keys, then the values (on each rank). SwiGLU's
fc1 holds each rank's gate rows, then its up rows, as ours does; in torch_dist the joined tensor is
[all gate rows; all up rows] (megatron-core's `apply_swiglu_sharded_factory`), our T=1 order.

Experts (`--num-experts`). The router's weight is `mlp.router.weight` [experts, hidden], DeepSpeed's gate's. torch_dist
stacks each expert tensor over the global experts after the layers, `decoder.layers.mlp.experts.experts.linear_fc1.weight`
[layers, experts, 2f, hidden] (one name for megatron-core's SequentialMLP, GroupedMLP and TEGroupedMLP); `torch` holds
SequentialMLP's `mlp.experts.local_experts.<e>.linear_fc1.weight` in each expert-parallel rank's file, read here
under the global index (`megatron_lm_files.RankTensors`). An expert's fc1 is [gate rows; up rows] as ours.
"""

from __future__ import annotations

from megatron_ds.config import ModelConfig
from megatron_ds.model import moe, naming
from megatron_ds.training.checkpoint.universal.names import ModelTensor

LAYERS = "decoder.layers."
LAYER_NAMES: dict[str, tuple[str, ...]] = {
    "input_norm.weight": ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    "input_norm.bias": ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    "qkv.weight": ("self_attention.linear_qkv.weight",),
    "qkv.bias": ("self_attention.linear_qkv.bias",),
    "q_norm.weight": ("self_attention.q_layernorm.weight",),  # --qk-layernorm (both specs' name)
    "q_norm.bias": ("self_attention.q_layernorm.bias",),
    "k_norm.weight": ("self_attention.k_layernorm.weight",),
    "k_norm.bias": ("self_attention.k_layernorm.bias",),
    "proj.weight": ("self_attention.linear_proj.weight",),
    "proj.bias": ("self_attention.linear_proj.bias",),
    "post_attention_norm.weight": ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    "post_attention_norm.bias": ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
    "fc1.weight": ("mlp.linear_fc1.weight",),
    "fc1.bias": ("mlp.linear_fc1.bias",),
    "fc2.weight": ("mlp.linear_fc2.weight",),
    "fc2.bias": ("mlp.linear_fc2.bias",),
}
LAYER_NAMES[moe.GATE_WEIGHT] = ("mlp.router.weight",)
LAYER_NAMES[moe.SHARED_EXPERT_PREFIX + "fc1.weight"] = ("mlp.shared_experts.linear_fc1.weight",)  # SharedExpertMLP
LAYER_NAMES[moe.SHARED_EXPERT_PREFIX + "fc2.weight"] = ("mlp.shared_experts.linear_fc2.weight",)
LAYER_NAMES[moe.SHARED_EXPERT_PREFIX + "gate.weight"] = ("mlp.shared_experts.gate_weight",)  # [1, hidden]
"""Our TransformerLayer keys -> megatron-core's names in a layer (canonical first, then the local spec's)."""
EXPERT_NAMES = {k: LAYER_NAMES[k][0].removeprefix("mlp.") for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}
"""An expert's keys -> megatron-core's within the expert."""
NAMES: dict[tuple[str, str], str] = {
    (naming.WORD_EMBEDDING, "weight"): "embedding.word_embeddings.weight",
    (naming.POSITION_EMBEDDING, "weight"): "embedding.position_embeddings.weight",
    (naming.FINAL_NORM, "norm.weight"): "decoder.final_layernorm.weight",
    (naming.FINAL_NORM, "norm.bias"): "decoder.final_layernorm.bias",
    (naming.UNTIED_LM_HEAD, "weight"): "output_layer.weight",
}
"""Our other tensors (spec, key) -> megatron-core's names."""
FUSED_QKV = ("qkv.weight", "qkv.bias")
IGNORED_SUFFIXES = ("_extra_state",)
"""Entries that are not weights (Transformer Engine's FP8 metadata, megatron-core's placeholders)."""


def names(model: ModelConfig, tensor: ModelTensor) -> tuple[tuple[str, ...], int | None]:
    """megatron-core's candidate names of `tensor` and its layer (None outside the layers); an expert's: torch_dist's
    stacked name (`expert` gives its index there), then the `torch` format's by global index."""
    if tensor.spec == naming.TRANSFORMER_LAYER:
        layer = tensor.spec_index - len(naming.gpt_spec_groups(model).pre)
        found = _expert(tensor)
        if found is not None:
            index, key = found
            return (
                f"mlp.experts.experts.{EXPERT_NAMES[key]}",
                f"mlp.experts.local_experts.{index}.{EXPERT_NAMES[key]}",
            ), layer
        return LAYER_NAMES[tensor.key], layer
    key = tensor.key if tensor.spec != naming.UNTIED_LM_HEAD else "weight"
    return (NAMES[tensor.spec, key],), None


def expert(tensor: ModelTensor) -> int | None:
    """The global index of an expert's tensor (its place on torch_dist's expert axis); None for other tensors."""
    found = _expert(tensor)
    return None if found is None else found[0]


def _expert(tensor: ModelTensor) -> tuple[int, str] | None:
    """(global index, key within the expert) of an expert's tensor, else None."""
    if tensor.spec != naming.TRANSFORMER_LAYER or not tensor.key.startswith(moe.EXPERT_PREFIX):
        return None
    index, key = tensor.key[len(moe.EXPERT_PREFIX) :].split(".", 1)
    return int(index), key
