"""Names of the GPT layer specs, grouped as the layout engine sees them. Pure: no torch import.

`megatron_ds.model.gpt_pipe.build_layer_specs` builds specs with exactly these names, in this
order (it asserts so), which lets `--print-layout` and the planner show a layout without
building anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.config import ModelConfig, shapes
from megatron_ds.pipeline.layout import SpecGroups

# Pre-processing: input dtype conversion, word embedding (tied), position embedding + dropout
# (or the dropout alone when the model has no learned position embedding).
CAST_INPUTS = "cast_token_ids"
WORD_EMBEDDING = "WordEmbedding"
POSITION_EMBEDDING = "PositionEmbedding"
EMBEDDING_DROPOUT = "EmbeddingDropout"
# Body: one spec per transformer layer.
TRANSFORMER_LAYER = "TransformerLayer"
# Post-processing: final norm, LM head (tied word embedding or untied), fp32 conversion; then the loss.
FINAL_NORM = "FinalNorm"
TIED_LM_HEAD = "WordEmbedding.lm_head_logits"
UNTIED_LM_HEAD = "LMHead"
LOGITS_TO_FP32 = "logits_to_fp32"
LOSS = "cross_entropy_loss"

# DeepSpeed's TiedLayerSpec key of the word embedding shared by the first and last stage.
TIED_EMBEDDING_KEY = "word_embeddings"


def gpt_spec_groups(model: ModelConfig) -> SpecGroups:
    """The spec names of a GPT with this configuration."""
    head = UNTIED_LM_HEAD if model.untie_embeddings_and_output_weights else TIED_LM_HEAD
    position = POSITION_EMBEDDING if model.add_position_embedding else EMBEDDING_DROPOUT
    return SpecGroups(
        pre=(CAST_INPUTS, WORD_EMBEDDING, position),
        num_layers=model.num_layers,
        post=(FINAL_NORM, head, LOGITS_TO_FP32),
        layer_name=TRANSFORMER_LAYER,
        loss_name=LOSS,
    )


@dataclass(frozen=True)
class SpecParams:
    """One spec's parameters on one tensor-parallel rank."""

    num_params: int
    largest: int
    """Its largest single module (ZeRO-3 gathers one module at a time)."""
    no_decay: int
    """Biases and norm parameters: the no-weight-decay group (`training/optimizer.py`)."""


def gpt_spec_params(model: ModelConfig, tensor_parallel_size: int = 1) -> list[SpecParams]:
    """Parameters of each spec per tensor-parallel rank, in spec order, from `megatron_ds.config.shapes`.

    The tied LM head counts the word embedding again: it is a second copy when the head is on
    another stage (callers that want unique parameters drop it, see `estimate.memory_model.total_params`).
    """
    t = tensor_parallel_size
    vocab = shapes.word_embedding_params(model, t)
    norm = model.norm_params
    layer = shapes.layer_params(model, t)
    position = shapes.position_embedding_params(model)
    by_name = {
        CAST_INPUTS: SpecParams(0, 0, 0),
        WORD_EMBEDDING: SpecParams(vocab, vocab, 0),
        POSITION_EMBEDDING: SpecParams(position, position, 0),
        EMBEDDING_DROPOUT: SpecParams(0, 0, 0),
        TRANSFORMER_LAYER: SpecParams(layer.total, layer.largest, layer.no_decay),
        FINAL_NORM: SpecParams(norm, norm, norm),
        TIED_LM_HEAD: SpecParams(vocab, vocab, 0),
        UNTIED_LM_HEAD: SpecParams(vocab, vocab, 0),
        LOGITS_TO_FP32: SpecParams(0, 0, 0),
    }
    return [by_name[name] for name in gpt_spec_groups(model).names]


def gpt_spec_param_counts(model: ModelConfig) -> list[int]:
    """Parameters held by each spec at T=1 (for `--pp-partition-method parameters`)."""
    return [spec.num_params for spec in gpt_spec_params(model)]
