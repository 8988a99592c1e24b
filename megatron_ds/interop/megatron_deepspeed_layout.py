"""Where each of our tensors lives in a Megatron-DeepSpeed GPTModelPipe checkpoint (or a `--no-pipeline-parallel`
GPTModel one: `NO_PIPELINE_SPEC`).

GPTModelPipe's specs (`megatron/model/gpt_model.py`), by index XX of the layer files:

    0        _to_float16                         (function)
    1        EmbeddingPipe: word_embeddings.weight, position_embeddings.weight (a TiedLayerSpec
             'embed' unless --untie-embeddings-and-output-weights: then the last stage holds a
             copy of the whole module, position table included, as `tied_modules.embed.*`)
    2..L+1   ParallelTransformerLayerPipe: input_layernorm, self_attention.query_key_value,
             self_attention.dense, post_attention_layernorm, mlp.dense_h_to_4h, mlp.dense_4h_to_h
    L+2      LayerNorm or RMSNorm: weight (, bias)
    L+3      the tied EmbeddingPipe's logits (no file), or LMHeadPipe: lm_head.weight
    L+4      float16_to_fp32 (fp16 and bf16 runs only)

Stages: DeepSpeed's `type:transformer` partition (balanced over the transformer layers), which
GPTModelPipe hard-codes. Tensor-parallel shards are cut as ours are (vocabulary rows, column-
parallel QKV and fc1 rows, row-parallel dense and fc2 columns), except the fused QKV rows of one
rank, whose order depends on the release (`QKV_LAYOUTS`); SwiGLU's fc1 holds each rank's gate
block, then its up block, as ours does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ds.config import ModelConfig
from megatron_ds.model import naming
from megatron_ds.pipeline import partition
from megatron_ds.training.checkpoint.universal.names import ModelTensor, model_tensors

BLOCKED, INTERLEAVED = "blocked", "interleaved"
QKV_LAYOUTS = (BLOCKED, INTERLEAVED)
"""Row order of one tensor rank's fused QKV weight and bias. `blocked`: all of the rank's query
heads, then its key heads, then its value heads (Megatron-DeepSpeed since PR #441, Dec 2024, and
at its current commit: `mixed_x_layer[..., :projection_size]` ...). `interleaved`: per key/value
group, its query heads, its key head, its value head (older releases, and PR #469: the view
`[sq, b, nkv, nq/nkv + 2, hd]` of `split_tensor`; also what `tools/hf2megads_weight_converter.py` writes, at the
current commit too). A trained checkpoint does not say which; a converter's output does (its saved args:
`megatron_deepspeed.written_qkv_layout`)."""

LAYER_KEYS = {
    "input_norm.weight": "input_layernorm.weight",
    "input_norm.bias": "input_layernorm.bias",
    "qkv.weight": "self_attention.query_key_value.weight",
    "qkv.bias": "self_attention.query_key_value.bias",
    "proj.weight": "self_attention.dense.weight",
    "proj.bias": "self_attention.dense.bias",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_attention_norm.bias": "post_attention_layernorm.bias",
    "fc1.weight": "mlp.dense_h_to_4h.weight",
    "fc1.bias": "mlp.dense_h_to_4h.bias",
    "fc2.weight": "mlp.dense_4h_to_h.weight",
    "fc2.bias": "mlp.dense_4h_to_h.bias",
}
"""Our TransformerLayer keys -> ParallelTransformerLayer's, in both modules' registration order."""
TIED_PREFIX = "tied_modules.embed."
EMBEDDING_SPEC = 1
FIRST_LAYER_SPEC = 2
NO_PIPELINE_SPEC = -1
"""`Place.spec_index` of a `--no-pipeline-parallel` run's tensors: GPTModel on DeepSpeed's plain engine saves no
layer files; each tensor rank's `mp_rank_TT_model_states.pt` holds the whole model's nested `module` dict
(`language_model.embedding.*`, `language_model.encoder.layers.N.*`, `language_model.encoder.final_layernorm.*`,
`language_model.output_layer.weight` when untied), whose dotted names are also the optimizer's."""


@dataclass(frozen=True)
class Place:
    """One tensor in Megatron-DeepSpeed's files."""

    spec_index: int
    """XX of `layer_XX-model_RR-model_states.pt`."""
    key: str
    """Its key in that file."""
    module_name: str
    """Its name in the stage's `named_parameters()` (optimizer state, ZeRO fragments)."""
    group: int
    """Its optimizer group: 0 weight decay, 1 none (Megatron's rule: biases and 1-D tensors)."""


def num_specs(model: ModelConfig, half_precision: bool) -> int:
    return model.num_layers + 4 + (1 if half_precision else 0)


def stage_parts(model: ModelConfig, pipeline_parallel: int, half_precision: bool) -> list[int]:
    """The first spec index of each stage (and the count at the end), as DeepSpeed's `type:transformer`."""
    weights = [0] * num_specs(model, half_precision)
    for i in range(model.num_layers):
        weights[FIRST_LAYER_SPEC + i] = 1
    return partition.balanced(weights, pipeline_parallel)


def _tied(model: ModelConfig) -> bool:
    return not model.untie_embeddings_and_output_weights


def place(model: ModelConfig, tensor: ModelTensor, no_pipeline: bool = False) -> Place:
    """Where `tensor` (one of ours) is stored by GPTModelPipe (or, `no_pipeline`, by GPTModel)."""
    p = _pipeline_place(model, tensor)
    if not no_pipeline:
        return p
    name = _no_pipeline_name(model, p)
    return Place(NO_PIPELINE_SPEC, name, name, p.group)


def _pipeline_place(model: ModelConfig, tensor: ModelTensor) -> Place:
    group = 0 if len(tensor.rule.shape) >= 2 else 1
    if tensor.spec in (naming.WORD_EMBEDDING, naming.POSITION_EMBEDDING):
        key = "word_embeddings.weight" if tensor.spec == naming.WORD_EMBEDDING else "position_embeddings.weight"
        prefix = TIED_PREFIX if _tied(model) else f"{EMBEDDING_SPEC}."
        return Place(EMBEDDING_SPEC, key, prefix + key, group)
    if tensor.spec == naming.TRANSFORMER_LAYER:
        first = len(naming.gpt_spec_groups(model).pre)
        index = FIRST_LAYER_SPEC + tensor.spec_index - first
        key = LAYER_KEYS[tensor.key]
        return Place(index, key, f"{index}.{key}", group)
    if tensor.spec == naming.FINAL_NORM:
        index, key = model.num_layers + 2, tensor.key.removeprefix("norm.")
        return Place(index, key, f"{index}.{key}", group)
    if tensor.spec == naming.UNTIED_LM_HEAD:
        index = model.num_layers + 3
        return Place(index, "lm_head.weight", f"{index}.lm_head.weight", group)
    raise AssertionError(tensor.spec)


def _no_pipeline_name(model: ModelConfig, p: Place) -> str:
    """GPTModel's dotted name of the tensor GPTModelPipe keeps at `p` (the same module keys, another nesting)."""
    if p.spec_index == EMBEDDING_SPEC:
        return f"language_model.embedding.{p.key}"
    if p.spec_index == model.num_layers + 2:
        return f"language_model.encoder.final_layernorm.{p.key}"
    if p.spec_index == model.num_layers + 3:
        return "language_model.output_layer.weight"  # GPTModelPipe's LMHeadPipe calls it lm_head
    return f"language_model.encoder.layers.{p.spec_index - FIRST_LAYER_SPEC}.{p.key}"


def stage_of(parts: list[int], spec_index: int) -> int:
    return next(s for s in range(len(parts) - 1) if parts[s] <= spec_index < parts[s + 1])


def stage_parameters(
    model: ModelConfig, parts: list[int], stage: int, no_pipeline: bool = False
) -> list[tuple[str, ModelTensor]]:
    """(module name, our tensor) of the stage's parameters in `named_parameters()` order: the tied
    embedding module first (on the first stage, and its copy on the last), then each spec's. `no_pipeline`:
    GPTModel's, in its registration order (ours too)."""
    if no_pipeline:
        return [(place(model, t, no_pipeline=True).module_name, t) for t in model_tensors(model)]
    specs = range(parts[stage], parts[stage + 1])
    tensors = [(place(model, t), t) for t in model_tensors(model)]
    tied_specs = {EMBEDDING_SPEC, model.num_layers + 3} if _tied(model) else set()
    out = []
    if tied_specs & set(specs):
        out += [(p.module_name, t) for p, t in tensors if p.spec_index == EMBEDDING_SPEC]
    out += [(p.module_name, t) for p, t in tensors if p.spec_index in specs and p.spec_index not in tied_specs]
    return out


def optimizer_index(model: ModelConfig, parts: list[int], stage: int, no_pipeline: bool = False) -> dict[str, int]:
    """Each parameter's number in the stage's torch optimizer state: group 0's, then group 1's."""
    params = stage_parameters(model, parts, stage, no_pipeline)
    ordered = [name for g in (0, 1) for name, t in params if place(model, t).group == g]
    return {name: i for i, name in enumerate(ordered)}


def qkv_to_blocked(shard: torch.Tensor, model: ModelConfig, tensor_parallel: int) -> torch.Tensor:
    """One rank's interleaved QKV rows (weight or bias) in blocked order (q heads, k heads, v heads)."""
    nkv = model.kv_heads // tensor_parallel
    groups = model.num_attention_heads // model.kv_heads
    hd = model.head_dim
    per_group = shard.reshape(nkv, groups + 2, hd, *shard.shape[1:])
    q = per_group[:, :groups].reshape(nkv * groups * hd, *shard.shape[1:])
    k = per_group[:, groups].reshape(nkv * hd, *shard.shape[1:])
    v = per_group[:, groups + 1].reshape(nkv * hd, *shard.shape[1:])
    return torch.cat((q, k, v)).contiguous()


MOE_MLP_KEYS = {"fc1": "dense_h_to_4h", "fc2": "dense_4h_to_h"}
"""Our expert (and PR-MoE residual) MLP keys -> Megatron-DeepSpeed's ParallelMLP's."""


def moe_key(key: str) -> str:
    """Our MoE-layer key (`model.moe.layer_tensor_rules`) -> GPTModel's within the transformer layer: DeepSpeed's MoE
    layer is its `mlp` (`moe.deepspeed_moe.gate.wg.weight` -> `mlp.deepspeed_moe.gate.wg.weight`, an expert's or the
    residual MLP's `fc1` -> `dense_h_to_4h`, `moe.coefficient.*` -> `mlp.coefficient.*`)."""
    parts = key.removeprefix("moe.").split(".")
    return "mlp." + ".".join(MOE_MLP_KEYS.get(p, p) for p in parts)


def expert_places(world_size: int, expert_parallel_size: int, data_before_expert: bool) -> list[tuple[int, int]]:
    """(expert-parallel rank, expert-data-parallel rank) of each global rank at P = T = 1, as DeepSpeed's
    `_create_expert_and_data_parallel` groups them: expert-parallel groups of consecutive ranks (rank d is r = d mod E,
    q = d // E), or with `use_data_before_expert_parallelism` consecutive expert-data-parallel groups (r = d // (W/E),
    q = d mod (W/E))."""
    stride = world_size // expert_parallel_size
    if data_before_expert:
        return [(d // stride, d % stride) for d in range(world_size)]
    return [(d % expert_parallel_size, d // expert_parallel_size) for d in range(world_size)]
