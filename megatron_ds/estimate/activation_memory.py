"""Activation bytes one micro-batch leaves saved for backward, per layer spec of our GPT.

Reference: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198), Sec. 4.1-4.2. For a 16-bit transformer layer without recomputation
the paper counts sbh(34 + 5as/h) bytes (s sequence, b micro-batch, h hidden, a heads), and with
t-way tensor parallelism (no sequence parallelism) sbh(10 + 24/t + 5as/(ht)). We apply the same
per-tensor accounting to `megatron_ds.model.transformer.TransformerLayer`, with the byte width of
each saved tensor taken from the kernels that actually run (`activation_kernels.SavedWidths`) and each rank's share
cut as `activation_kernels.Split` says (`activation_kernels.py` gives both rules).

This module owns a layer's terms outside the core attention (norms, the linears' inputs, the MLP's activation,
residual dropout masks), what full recomputation keeps (`checkpointed_layer_bytes`, `checkpoint_rng_bytes`), the
pre- and post-processing specs' terms, the logits and the loss. The core attention's terms, from the QKV output to
the projection's input (rotary embeddings, head norms, the SDPA kernels, sliding windows, packed documents' mask),
are `attention_activations.py`'s; `transformer_layer_terms` adds them.

Packed documents: with either packed-documents flag the two int64 id tensors (`DOCUMENT_ID_BYTES` per token) travel
with every activation (pipe buffers, `transients.py`) and are kept by full recomputation with each checkpointed
chunk's input. A zero-centred norm (`--apply-layernorm-1p`) also saves the weight + 1 it computes with.
"""

from __future__ import annotations

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.estimate.activation_kernels import (
    DOCUMENT_ID_BYTES,
    LOSS_MASK_BYTES,
    TOKEN_ID_BYTES,
    SavedWidths,
    Split,
    as_split,
    norm_saved,
)
from megatron_ds.estimate.attention_activations import attention_terms
from megatron_ds.model import activations, norms


def _one_plus_weights(model: ModelConfig, k: SavedWidths, widths: int) -> float:
    """A zero-centred norm (`--apply-layernorm-1p`) computes with weight + 1, a new tensor each forward that the norm
    saves: `widths` channels of them (whole on every rank), in the compute dtype."""
    return widths * k.w if norms.find(model.normalization).zero_centered_gamma else 0.0


def transformer_layer_terms(
    model: ModelConfig,
    micro_batch_size: int,
    k: SavedWidths,
    split: Split | int = 1,
    *,
    regularization: RegularizationConfig,
    document_mask: bool = False,
    window: int | None = None,
    position_ids: bool = False,
) -> dict[str, float]:
    """Saved bytes of one TransformerLayer for one micro-batch, by tensor (Korthikanti Sec. 4.1 terms);
    dropout masks exist only when `regularization`'s probabilities are > 0. `split`: a `Split`, or the
    tensor-parallel size. `document_mask`: `--reset-attention-mask`'s dense mask; `window`: the layer's sliding
    window; `position_ids`: packed documents' position ids (either flag), by which rotary embeddings rotate (module
    docstrings, this one's and `attention_activations.py`'s)."""
    sp = as_split(split)
    b, s, h, f = micro_batch_size, model.seq_length, model.hidden_size, model.ffn_hidden_size
    r, t, q = sp.replicated, sp.split, model.query_size
    sbh, bs = s * b * h, s * b
    drop_h = regularization.hidden_dropout > 0
    drop_a = regularization.attention_dropout > 0
    norm_input, norm_output, norm_stats = norm_saved(norms.find(model.normalization), k, sbh, bs)
    terms = {
        # Replicated over tensor-parallel ranks (the paper's "10"): norm inputs, qkv and fc1 inputs, masks.
        "norm inputs": 2 * norm_input / r,
        "norm statistics": 2 * norm_stats / r,
        "qkv input": sbh * k.w / r,
        "fc1 input": sbh * k.w / r,
        "residual dropout masks": (2 * sbh * k.mask / r) if drop_h else 0,
        # Split over tensor-parallel ranks (the paper's "24/t").
        "projection input": s * b * q * k.w / t,  # heads x head size wide (h unless --kv-channels)
        # GeLU saves its input (the paper's 4h-wide "GeLU input"); SwiGLU fc1's two halves and silu's output.
        f"{model.activation} inputs": activations.find(model.activation).saved_features * s * b * f * k.w / t,
        "fc2 input": s * b * f * k.w / t,
    }
    if norm_output:  # CPU's composite RMSNorm
        terms["norm outputs"] = 2 * norm_output / r
    head_norms = 2 * model.head_dim if model.qk_layernorm else 0
    if one_plus := _one_plus_weights(model, k, 2 * h + head_norms):
        terms["norm weights + 1"] = one_plus
    # from the QKV output to the projection's input: rotary, the head norms, the core attention, the document mask
    attention = attention_terms(
        model, b, k, sp, dropout=drop_a, document_mask=document_mask, window=window, position_ids=position_ids
    )
    return terms | attention


CPU_RNG_STATE_BYTES = 5056
"""torch.get_rng_state() on the CPU (mt19937)."""


def checkpoint_rng_bytes(k: SavedWidths, tracker_streams: int) -> float:
    """What one call of DeepSpeed's activation checkpointing keeps for its recompute besides its inputs: the
    CPU generator's state, the accelerator's, and every stream of the RNG tracker (`CheckpointFunction.forward`)."""
    return CPU_RNG_STATE_BYTES + k.rng_state * (1 + tracker_streams)


def korthikanti_layer_bytes(
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    num_heads: int,
    tensor_parallel_size: int = 1,
    sequence_parallel: bool = False,
    selective: bool = False,
) -> float:
    """The paper's closed forms (16-bit, 4h MLP), Sec. 4.2 and 5: sbh(10 + 24/t + 5as/(ht)); with
    sequence parallelism sbh/t (34 + 5as/h); selective recomputation drops the 5as/h term."""
    s, b, h, a, t = seq_length, micro_batch_size, hidden_size, num_heads, tensor_parallel_size
    scores = 0 if selective else 5 * a * s / h
    if sequence_parallel:
        return s * b * h / t * (34 + scores)
    return s * b * h * (10 + 24 / t + scores / t)


def checkpointed_layer_bytes(
    model: ModelConfig,
    micro_batch_size: int,
    k: SavedWidths,
    split: Split | int = 1,
    document_ids: bool = False,
    partitioned: bool = False,
    on_host: bool = False,
) -> float:
    """With full recomputation only a chunk's input survives: 2sbh in the paper's 16-bit terms (sbh/t with
    sequence parallelism, sbh/N under Ulysses: the layer's input is this rank's part); with packed documents'
    `document_ids` also the whole sample's two int64 id tensors.

    DeepSpeed's options (`training.activation_checkpointing`): `partitioned` (`--partition-activations`) keeps
    1/t of the input on each tensor rank; `on_host` (`--checkpoint-in-cpu`) keeps it in host memory, none on the
    device. Both act on floating-point inputs only: the integer ids stay where they are. (The recompute gathers
    or copies one chunk's input back for its backward, within the recompute's own transient.)"""
    sp = as_split(split)
    ids = model.seq_length * micro_batch_size * DOCUMENT_ID_BYTES if document_ids else 0
    if on_host:
        return ids
    hidden = model.seq_length * micro_batch_size * model.hidden_size * k.w / sp.replicated
    return hidden / (sp.tensor if partitioned else 1) + ids


def pre_terms(
    model: ModelConfig,
    micro_batch_size: int,
    k: SavedWidths,
    *,
    regularization: RegularizationConfig,
    split: Split | int = 1,
) -> dict[str, dict[str, float]]:
    """Saved bytes of the pre-processing specs, keyed by spec name."""
    sp = as_split(split)
    bs = model.seq_length * micro_batch_size
    dropout = bs * model.hidden_size * k.mask / sp.replicated if regularization.hidden_dropout > 0 else 0
    return {
        "cast_token_ids": {},
        "WordEmbedding": {"token ids (embedding backward)": bs * TOKEN_ID_BYTES / sp.ulysses},
        # spec 2 is PositionEmbedding, or a bare EmbeddingDropout for rotary models (no position table)
        ("PositionEmbedding" if model.add_position_embedding else "EmbeddingDropout"): {
            "embedding dropout mask": dropout
        },
    }


def post_terms(
    model: ModelConfig, micro_batch_size: int, k: SavedWidths, head_name: str, split: Split | int = 1
) -> dict[str, dict[str, float]]:
    """Saved bytes of the post-processing specs (the loss's saved tensors are put on logits_to_fp32).
    Under sequence parallelism the head's linear saves its input split (and gathers it again in backward)."""
    sp = as_split(split)
    bs = model.seq_length * micro_batch_size
    sbh = bs * model.hidden_size
    bsv = bs * model.vocab_size / (sp.tensor * sp.ulysses)  # vocab-parallel logits under tensor parallelism
    norm_input, norm_output, norm_stats = norm_saved(norms.find(model.normalization), k, sbh, bs)
    final_norm = {"norm input": norm_input / sp.replicated, "norm statistics": norm_stats / sp.replicated}
    if norm_output:  # CPU's composite RMSNorm
        final_norm["norm output"] = norm_output / sp.replicated
    if one_plus := _one_plus_weights(model, k, model.hidden_size):
        final_norm["norm weight + 1"] = one_plus
    return {
        "FinalNorm": final_norm,
        head_name: {"LM head input": sbh * k.w / sp.replicated},
        # log_softmax saves its float32 output (nll_loss reuses it); the fp32 logits themselves are not
        # saved by autograd but DeepSpeed keeps them as the stage output (see `logits_bytes`). At T > 1
        # the saved softmax is that same storage (`loss_in_logits`). Under Ulysses each rank holds its
        # part of the labels and all of the loss mask.
        "logits_to_fp32": {
            "fp32 log-probabilities": 4 * bsv,
            "labels and loss mask": bs * (TOKEN_ID_BYTES / sp.ulysses + LOSS_MASK_BYTES) + 8,
            **({"vocabulary-parallel target mask": bs - 4} if sp.tensor > 1 else {}),  # bool; one scalar fewer
        },
    }


def logits_bytes(model: ModelConfig, micro_batch_size: int, tensor_parallel_size: int = 1, ulysses: int = 1) -> float:
    """The float32 logits of one micro-batch, which the last stage's pipe buffer keeps until backward."""
    return 4 * model.seq_length * micro_batch_size * model.vocab_size / (tensor_parallel_size * ulysses)


def loss_in_logits(tensor_parallel_size: int) -> bool:
    """Whether the loss works in the float32 logits themselves rather than beside them: megatron-core's
    vocabulary-parallel cross entropy (T > 1; Ulysses runs at T = 1 with torch's). Its forward
    (`_VocabParallelCrossEntropy`, megatron/core/tensor_parallel/cross_entropy.py) takes
    `vocab_parallel_logits.float()` (the tensor itself when it is float32, as `logits_to_fp32`'s output
    is), subtracts the max in place, exponentiates into it (`torch.exp(..., out=exp_logits)`), divides
    in place and saves it as the softmax; its backward makes the logits' gradient in that storage
    (`grad_input = softmax`, `grad_2d[arange_1d, masked_target_1d] -= ...`, `grad_input.mul_`). So a
    micro-batch's saved softmax, its logits' gradient and the logits the pipe buffer keeps are one
    tensor."""
    return tensor_parallel_size > 1


def loss_backward_transient(
    model: ModelConfig, micro_batch_size: int, tensor_parallel_size: int = 1, ulysses: int = 1, compute_bytes: int = 4
) -> float:
    """Gradient buffers the loss backward allocates for one micro-batch beyond what it saved. torch's
    cross entropy (T = 1): d(log-probs) and d(logits), float32 b*s*v each (nll_loss and log_softmax
    backward). The vocabulary-parallel one (T > 1, `loss_in_logits`): none of its own; with 16-bit
    activations (`compute_bytes` < 4) the backward of `logits_to_fp32`'s cast (ToCopyBackward0) makes the
    gradient of the 16-bit logits, b*s*v/t of them."""
    fp32 = logits_bytes(model, micro_batch_size, tensor_parallel_size, ulysses)
    if loss_in_logits(tensor_parallel_size):
        return 0.0 if compute_bytes >= 4 else fp32 * compute_bytes / 4
    return 2 * fp32
