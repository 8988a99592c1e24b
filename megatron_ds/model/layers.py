"""The pre- and post-processing layers of the GPT pipeline, and the loss.

Contract between stages (batch-first, no side channels):
  tokens (b, s) int64 -> embeddings (b, s, h) -> ... -> hidden (b, s, h) in the compute dtype
  -> logits (b, s, v) -> logits (b, s, v) float32 -> loss (scalar float32).
Labels travel as the tuple (labels (b, s) int64, loss_mask (b, s) float32) to the last stage.
With packed documents (`--reset-position-ids`, `--reset-attention-mask`) the tokens come as (tokens, position_ids,
document_ids) and the ids travel beside every activation up to the final norm (`megatron_ds.model.documents`).

These are the T=1 forms; at T > 1 the word embedding, LM head and loss come from
`megatron_ds.model.tensor_parallel_layers` (vocabulary-parallel), the others are used as they are.

Split sequences: under Megatron's sequence parallelism the position embedding (or the bare embedding
dropout) scatters its output to this rank's part, sequence-first (s/T, b, h), and the hidden states stay
split to the LM head; under DeepSpeed-Ulysses each rank embeds its own part of the tokens (b, s/N) at its
positions. Dropout of a split tensor draws the unsplit tensor's mask (`rng.dropout`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import megatron_ds.model.norms as norms
from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.model import documents, moe_loss, weight_grad
from megatron_ds.model.init import init_generator, normal_
from megatron_ds.model.rng import Stream, dropout, register_streams
from megatron_ds.model.tensor_parallel import NO_TENSOR_PARALLEL, TensorParallel, mark_partial_gradient
from megatron_ds.model.tensor_parallel_rank import NO_ULYSSES, UlyssesGroup


def cast_token_ids(tokens: Any) -> Any:
    """Input dtype conversion: token ids to int64, whatever integer type the loader produced (packed
    documents' ids pass through)."""
    ids, carried = documents.split(tokens)
    return documents.join(ids.long(), carried)


def logits_to_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Upcast logits so the softmax and loss run in fp32 under bf16/fp16 training."""
    return logits.float()


class WordEmbedding(nn.Module):
    """The word-embedding matrix (v, h), alone, so the last stage holds nothing else of it."""

    def __init__(self, model: ModelConfig, regularization: RegularizationConfig, init_seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(model.vocab_size, model.hidden_size))
        normal_(self.weight, regularization.init_method_std, init_generator(init_seed))

    def forward(self, tokens: Any) -> Any:
        ids, carried = documents.split(tokens)
        return documents.join(F.embedding(ids, self.weight), carried)  # (b, s) -> (b, s, h)


def lm_head_logits(embedding: WordEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """Tied LM head (the TiedLayerSpec `forward_fn` on the last stage): (b, s, h) -> (b, s, v)."""
    return weight_grad.linear(hidden, embedding.weight)


class LMHead(nn.Module):
    """Untied output layer (`--untie-embeddings-and-output-weights`): its own (v, h) matrix."""

    def __init__(self, model: ModelConfig, regularization: RegularizationConfig, init_seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(model.vocab_size, model.hidden_size))
        normal_(self.weight, regularization.init_method_std, init_generator(init_seed))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return weight_grad.linear(hidden, self.weight)


class _EmbeddingOutput(nn.Module):
    """The constructor `PositionEmbedding` and `EmbeddingDropout` share: the module's own parameters
    (`add_parameters`), then the embedding dropout, the module's one stream."""

    def __init__(
        self,
        model: ModelConfig,
        regularization: RegularizationConfig,
        init_seed: int,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        ulysses: UlyssesGroup = NO_ULYSSES,
    ) -> None:
        super().__init__()
        self.add_parameters(model, regularization, init_seed)
        self.dropout = _SplitEmbeddingDropout(regularization, init_seed, tp, ulysses)
        register_streams(self, self.dropout.stream)

    def add_parameters(self, model: ModelConfig, regularization: RegularizationConfig, init_seed: int) -> None:
        """None here: only the dropout probability matters."""


class PositionEmbedding(_EmbeddingOutput):
    """Adds learned absolute position embeddings, then embedding dropout (replicated at T > 1)."""

    def add_parameters(self, model: ModelConfig, regularization: RegularizationConfig, init_seed: int) -> None:
        self.weight = nn.Parameter(torch.empty(model.max_position_embeddings, model.hidden_size))
        normal_(self.weight, regularization.init_method_std, init_generator(init_seed))

    def forward(self, embeddings: Any) -> Any:
        embeddings, carried = documents.split(embeddings)
        if carried:  # packed documents: each token at its position in its document
            position = F.embedding(carried[0], self.weight)  # (b, s, h)
            return documents.join(self.dropout(embeddings + position.to(embeddings.dtype)), carried)
        seq = embeddings.shape[1]  # this rank's tokens under Ulysses, from position `first`
        first = self.dropout.ulysses.rank * seq
        return self.dropout(embeddings + self.weight[first : first + seq].to(embeddings.dtype))


class EmbeddingDropout(_EmbeddingOutput):
    """Embedding dropout alone, in place of `PositionEmbedding` when there is no learned position
    embedding (`--no-position-embedding`, e.g. with rotary embeddings); no parameters, the stream
    PositionEmbedding would use."""

    def forward(self, embeddings: Any) -> Any:
        embeddings, carried = documents.split(embeddings)
        return documents.join(self.dropout(embeddings), carried)


class _SplitEmbeddingDropout(nn.Module):
    """The embedding's output (b, s, h) -> dropout, after Megatron's sequence parallelism scatters it to
    (s/T, b, h) (megatron-core's order: scatter, then dropout of the part)."""

    def __init__(
        self, regularization: RegularizationConfig, init_seed: int, tp: TensorParallel, ulysses: UlyssesGroup
    ) -> None:
        super().__init__()
        self.hidden_dropout = regularization.hidden_dropout
        self.stream = Stream.replicated(init_seed)
        self.tp, self.ulysses = tp, ulysses

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp.sequence_parallel:
            from megatron_ds.model.tensor_parallel_layers import scatter_to_sequence

            hidden = scatter_to_sequence(hidden, self.tp)
        shard = self.tp.shard if self.tp.sequence_parallel else self.ulysses.shard
        return dropout(hidden, self.hidden_dropout, self.training, self.stream, shard)


def make_norm(model: ModelConfig, tp: TensorParallel = NO_TENSOR_PARALLEL) -> nn.Module:
    """The norm the config names (`megatron_ds.model.norms`), over the hidden dimension; under sequence
    parallelism its gradients are partial sums over the tensor ranks (`mark_partial_gradient`)."""
    norm = norms.find(model.normalization).module(model.hidden_size, model.layernorm_epsilon)
    return mark_partial_gradient(norm) if tp.sequence_parallel else norm


def make_head_norm(model: ModelConfig, tp: TensorParallel = NO_TENSOR_PARALLEL) -> nn.Module | None:
    """The norm over one attention head's channels (`--qk-layernorm`: the config's norm; `--qk-l2-norm`: the weightless
    L2Norm; `norms.head_norm`), or None without either. Replicated over tensor ranks, each normalising only its own
    heads: at T > 1 its gradients are partial sums over the tensor ranks whether or not the sequence is split
    (megatron-core all-reduces q/k_layernorm gradients over the tensor group with any sequence_parallel setting:
    `finalize_model_grads`)."""
    kind = norms.head_norm(model)
    if kind is None:
        return None
    norm = kind.module(model.head_dim, model.layernorm_epsilon)
    return mark_partial_gradient(norm) if tp.size > 1 else norm


class FinalNorm(nn.Module):
    """The final norm before the LM head."""

    def __init__(
        self, model: ModelConfig, init_seed: int, tp: TensorParallel = NO_TENSOR_PARALLEL, takes_moe_loss: bool = False
    ) -> None:
        super().__init__()
        del init_seed  # norms start at weight 1, bias 0
        self.norm = make_norm(model, tp)
        self.takes_moe_loss = takes_moe_loss
        self.aggregated_moe_loss: torch.Tensor | None = None
        """With `takes_moe_loss` (experts on the pipeline engine): the sum of the MoE layers' load-balancing losses of
        the last forward, taken off the input (`megatron_ds.model.moe_loss`), for the loss."""

    def forward(self, hidden: Any) -> torch.Tensor:
        """The norm of the hidden states; packed documents' ids and the aggregated load-balancing loss end here (the
        head needs neither)."""
        hidden, self.aggregated_moe_loss = moe_loss.take(hidden, self.takes_moe_loss)
        return self.norm(documents.split(hidden)[0])


def cross_entropy_loss(logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean token cross entropy over unmasked positions of one micro-batch."""
    targets, loss_mask = labels
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(), reduction="none")
    mask = loss_mask.reshape(-1).float()
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)
