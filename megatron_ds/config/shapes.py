"""Derived sizes, computed once: padded vocabulary, transformer-layer weight shapes, parameter counts.

The model (`model/transformer.py` draws its weights with `layer_linear_shapes`), the layout naming
(`model/naming.gpt_spec_params`), the memory model and the planner all read these, so a count
cannot disagree with the modules that are built (`tests/unit/test_param_counts.py` compares them
with the real modules' `numel()`). Pure arithmetic: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ds.config.checks import at_least
from megatron_ds.config.model import ModelConfig

COLUMN_PARALLEL = ("qkv", "fc1")
"""Linears whose output features (and biases) are split over tensor-parallel ranks."""
ROW_PARALLEL = ("proj", "fc2")
"""Linears whose input features are split over tensor-parallel ranks; their biases are replicated."""


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Round up to a multiple of divisible_by x T, as Megatron does (keeps vocabulary shards aligned)."""
    at_least("--make-vocab-size-divisible-by", divisible_by, 1)
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def layer_linear_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """Full (T=1) weight shapes (out, in) of a transformer layer's linears, in the order the layer
    draws them: fused QKV, attention output projection, fc1 (gate and up halves with SwiGLU), fc2."""
    h, f = model.hidden_size, model.ffn_hidden_size
    return {"qkv": (model.qkv_rows, h), "proj": (h, h), "fc1": (model.fc1_rows, h), "fc2": (h, f)}


@dataclass(frozen=True)
class LayerParams:
    """One transformer layer's parameters on one tensor-parallel rank, by module, in registration order."""

    modules: tuple[tuple[str, int], ...]
    """(module name, its parameters on this rank): norms, qkv, proj, norm, fc1, fc2."""
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
    t, bias = tensor_parallel_size, 1 if model.add_bias_linear else 0
    shapes = layer_linear_shapes(model)

    def linear(name: str) -> int:
        rows, cols = shapes[name]
        if name in COLUMN_PARALLEL:
            return (rows * cols + bias * rows) // t
        return rows * cols // t + bias * rows

    norm = model.norm_params
    modules = (
        ("input_norm", norm),
        ("qkv", linear("qkv")),
        ("proj", linear("proj")),
        ("post_attention_norm", norm),
        ("fc1", linear("fc1")),
        ("fc2", linear("fc2")),
    )
    biases = sum(shapes[n][0] // (t if n in COLUMN_PARALLEL else 1) for n in shapes) if bias else 0
    return LayerParams(modules=modules, no_decay=2 * norm + biases)


def word_embedding_params(model: ModelConfig, tensor_parallel_size: int = 1) -> int:
    """The (v, h) word embedding, or an untied LM head, per tensor-parallel rank (vocabulary-parallel)."""
    return model.vocab_size * model.hidden_size // tensor_parallel_size


def position_embedding_params(model: ModelConfig) -> int:
    """The learned position table (replicated over tensor ranks); none without one (e.g. rotary models)."""
    return model.max_position_embeddings * model.hidden_size if model.add_position_embedding else 0
