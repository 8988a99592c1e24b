"""Names of the GPT layer specs, grouped as the layout engine sees them. Pure: no torch import.

`megatron_ds.model.gpt_pipe.build_layer_specs` builds specs with exactly these names, in this
order (it asserts so), which lets `--print-layout` and the planner show a layout without
building anything. Each spec's parameters are counted in `megatron_ds.model.shapes`.
"""

from __future__ import annotations

from megatron_ds.config import ModelConfig
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
