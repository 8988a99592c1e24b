"""Weight shapes and parameter counts of every GPT spec, computed once. Pure arithmetic: no torch.

The model (`model/transformer.py` draws its weights with `layer_linear_shapes`), the partition
method `parameters`, the memory model and the planner all read these, so a count cannot disagree
with the modules that are built (`tests/unit/test_param_counts.py` compares them with the real
modules' `numel()`, at T=1 and T=2). Spec names and their order come from `model/naming.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import megatron_ds.model.naming as naming
import megatron_ds.model.norms as norms
from megatron_ds.config.model import ModelConfig

COLUMN_PARALLEL = ("qkv", "fc1")
"""Linears whose output features (and biases) are split over tensor-parallel ranks; the others
(proj, fc2) split their input features and replicate their biases."""


def layer_linear_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """Full (T=1) weight shapes (out, in) of a transformer layer's linears, in the order the layer
    draws them: fused QKV, attention output projection (heads x head size -> h), fc1 (gate and up halves with
    SwiGLU), fc2."""
    h, f = model.hidden_size, model.ffn_hidden_size
    return {"qkv": (model.qkv_rows, h), "proj": (h, model.query_size), "fc1": (model.fc1_rows, h), "fc2": (h, f)}


def norm_params(model: ModelConfig) -> int:
    """Parameters of one norm (`norms.Norm.params_per_hidden` per hidden unit: LayerNorm's weight
    and bias, RMSNorm's weight)."""
    return norms.find(model.normalization).params_per_hidden * model.hidden_size


def head_norm_params(model: ModelConfig) -> int:
    """Parameters of the query and key norms together (each one norm over head_dim, replicated over tensor ranks:
    `--qk-layernorm`'s; `--qk-l2-norm`'s has none); 0 without them."""
    head = norms.head_norm(model)
    return 2 * head.params_per_hidden * model.head_dim if head else 0


@dataclass(frozen=True)
class LayerParams:
    """One transformer layer's parameters on one tensor-parallel rank, by module, in registration order."""

    modules: tuple[tuple[str, int], ...]
    """(module name, its parameters on this rank): norm, qkv, the query and key norms (--qk-layernorm), proj, norm,
    fc1, fc2."""
    no_decay: int
    """Biases and norm parameters: the no-weight-decay group (`training/optimizer.py`)."""

    @property
    def total(self) -> int:
        return sum(n for _, n in self.modules)

    @property
    def largest(self) -> int:
        """The largest single module (what ZeRO-3 gathers at once)."""
        return max(n for _, n in self.modules)


def layer_params(model: ModelConfig, tensor_parallel_size: int = 1) -> LayerParams:
    """Parameters of one transformer layer per tensor-parallel rank (megatron-core's sharding:
    column-parallel weights and biases split, row-parallel weights split and biases replicated,
    norms replicated)."""
    t = tensor_parallel_size
    shapes = layer_linear_shapes(model)

    def linear(name: str) -> int:
        rows, cols = shapes[name]
        bias = 1 if model.has_bias(name) else 0
        if name in COLUMN_PARALLEL:
            return (rows * cols + bias * rows) // t
        return rows * cols // t + bias * rows

    norm, head_norms = norm_params(model), head_norm_params(model)
    modules = (
        ("input_norm", norm),
        ("qkv", linear("qkv")),
        *((("q_norm", head_norms // 2), ("k_norm", head_norms // 2)) if head_norms else ()),
        ("proj", linear("proj")),
        ("post_attention_norm", norm),
        ("fc1", linear("fc1")),
        ("fc2", linear("fc2")),
    )
    biases = sum(shapes[n][0] // (t if n in COLUMN_PARALLEL else 1) for n in shapes if model.has_bias(n))
    return LayerParams(modules=modules, no_decay=2 * norm + head_norms + biases)


def moe_layer_params(model: ModelConfig, num_experts: int, expert_parallel_size: int = 1) -> LayerParams:
    """A transformer layer with experts on one rank (T = 1; `megatron_ds.model.moe`): attention and norms as a dense
    layer's, then the gate (h x experts, no bias), this rank's experts (experts / E copies of the MLP, biases as the
    dense MLP's) and with `mlp_type` residual the dense MLP beside them and its coefficient (h -> 2, with bias), or
    Megatron-LM's shared expert (fc1, fc2 and its gate h -> 1, replicated on every rank like the attention)."""
    dense, linears = layer_params(model), layer_linear_shapes(model)
    (fc1_rows, h), (_, ffn) = linears["fc1"], linears["fc2"]
    fc1_bias = fc1_rows if model.has_bias("fc1") else 0
    fc2_bias = h if model.has_bias("fc2") else 0
    expert = fc1_rows * h + fc1_bias + h * ffn + fc2_bias
    attention = [m for m in dense.modules if m[0] not in ("fc1", "fc2")]
    modules = [*attention, ("gate", h * num_experts), ("experts", expert * num_experts // expert_parallel_size)]
    no_decay = dense.no_decay - sum(
        rows for n, (rows, _) in linears.items() if n in ("fc1", "fc2") and model.has_bias(n)
    )
    no_decay += (fc1_bias + fc2_bias) * num_experts // expert_parallel_size
    if model.mlp_type == "residual":
        modules += [("residual_mlp", expert), ("coefficient", 2 * h + 2)]
        no_decay += fc1_bias + fc2_bias + 2
    shared = model.moe_shared_expert_size  # no biases (Megatron-LM's router refuses them)
    if shared:
        gate = h if model.moe_shared_expert_gate else 0
        modules.append(("shared_expert", (2 * shared if model.gated_mlp else shared) * h + shared * h + gate))
    return LayerParams(modules=tuple(modules), no_decay=no_decay)


def transformer_layer_params(
    model: ModelConfig, tensor_parallel_size: int = 1, expert_parallel_size: int = 1
) -> list[LayerParams]:
    """Each transformer layer's parameters on one rank: `layer_params`, or `moe_layer_params` where it has experts."""
    dense = layer_params(model, tensor_parallel_size)
    return [dense if n == 1 else moe_layer_params(model, n, expert_parallel_size) for n in model.experts_per_layer]


def word_embedding_params(model: ModelConfig, tensor_parallel_size: int = 1) -> int:
    """The (v, h) word embedding, or an untied LM head, per tensor-parallel rank (vocabulary-parallel)."""
    return model.vocab_size * model.hidden_size // tensor_parallel_size


def position_embedding_params(model: ModelConfig) -> int:
    """The learned position table (replicated over tensor ranks); none without one (e.g. rotary models)."""
    return model.max_position_embeddings * model.hidden_size if model.add_position_embedding else 0


@dataclass(frozen=True)
class SpecParams:
    """One spec's parameters on one tensor-parallel rank."""

    num_params: int
    largest: int
    """Its largest single module (ZeRO-3 gathers one module at a time)."""
    no_decay: int
    """Biases and norm parameters: the no-weight-decay group (`training/optimizer.py`)."""
    expert_params: int = 0
    """Of `num_params`, this rank's experts' (a mixture-of-experts layer): ZeRO partitions their state over the
    expert-data-parallel group (data-parallel size / E ranks), not the whole data-parallel group."""


def gpt_spec_params(
    model: ModelConfig, tensor_parallel_size: int = 1, expert_parallel_size: int = 1
) -> list[SpecParams]:
    """Parameters of each spec per tensor-parallel rank, in spec order (`naming.gpt_spec_groups`); a layer with
    experts holds its experts / `expert_parallel_size` of them.

    The tied LM head counts the word embedding again: it is a second copy when the head is on
    another stage (callers that want unique parameters drop it, see `total_params`).
    """
    t = tensor_parallel_size
    vocab = word_embedding_params(model, t)
    norm = norm_params(model)
    layer = layer_params(model, t)
    position = position_embedding_params(model)
    by_name = {
        naming.CAST_INPUTS: SpecParams(0, 0, 0),
        naming.WORD_EMBEDDING: SpecParams(vocab, vocab, 0),
        naming.POSITION_EMBEDDING: SpecParams(position, position, 0),
        naming.EMBEDDING_DROPOUT: SpecParams(0, 0, 0),
        naming.TRANSFORMER_LAYER: SpecParams(layer.total, layer.largest, layer.no_decay),
        naming.FINAL_NORM: SpecParams(norm, norm, norm),
        naming.TIED_LM_HEAD: SpecParams(vocab, vocab, 0),
        naming.UNTIED_LM_HEAD: SpecParams(vocab, vocab, 0),
        naming.LOGITS_TO_FP32: SpecParams(0, 0, 0),
    }
    names = naming.gpt_spec_groups(model).names
    out = [by_name[name] for name in names]
    if model.is_moe:
        first = names.index(naming.TRANSFORMER_LAYER)
        for i, lp in enumerate(transformer_layer_params(model, t, expert_parallel_size)):
            experts = sum(n for name, n in lp.modules if name == "experts")
            out[first + i] = SpecParams(lp.total, lp.largest, lp.no_decay, experts)
    return out


def gpt_spec_tensor_numels(model: ModelConfig, tensor_parallel_size: int = 1) -> list[tuple[int, ...]]:
    """Each spec's parameter tensors, as element counts per tensor-parallel rank, in spec order (ZeRO-3 keeps a
    tensor at or below its persistence threshold whole on every rank)."""
    t, h = tensor_parallel_size, model.hidden_size
    per_norm = norms.find(model.normalization).params_per_hidden
    norm = (h,) * per_norm
    head = norms.head_norm(model)
    head_norms = (model.head_dim,) * (2 * head.params_per_hidden) if head else ()
    layer: list[int] = [*norm, *norm, *head_norms]
    for name, (rows, cols) in layer_linear_shapes(model).items():
        column = name in COLUMN_PARALLEL
        layer.append(rows * cols // t)
        if model.has_bias(name):
            layer.append(rows // t if column else rows)
    vocab = (word_embedding_params(model, t),)
    position = (position_embedding_params(model),) if model.add_position_embedding else ()
    by_name = {
        naming.WORD_EMBEDDING: vocab,
        naming.POSITION_EMBEDDING: position,
        naming.TRANSFORMER_LAYER: tuple(layer),
        naming.FINAL_NORM: norm,
        naming.TIED_LM_HEAD: vocab,
        naming.UNTIED_LM_HEAD: vocab,
    }
    return [by_name.get(name, ()) for name in naming.gpt_spec_groups(model).names]


def gpt_spec_param_counts(model: ModelConfig) -> list[int]:
    """Parameters held by each spec at T=1 (for `--pp-partition-method parameters`)."""
    return [spec.num_params for spec in gpt_spec_params(model)]


def total_params(model: ModelConfig) -> int:
    """Unique parameters of the whole model (the tied head counted once), tensor-parallel size 1."""
    specs = gpt_spec_params(model)
    tied = [i for i, name in enumerate(naming.gpt_spec_groups(model).names) if name == naming.TIED_LM_HEAD]
    return sum(sp.num_params for i, sp in enumerate(specs) if i not in tied)


def largest_layer_params(model: ModelConfig) -> int:
    """Largest single module's own parameters, as DeepSpeed's `zero.stage3.model_to_params` counts it."""
    return max(sp.largest for sp in gpt_spec_params(model))
