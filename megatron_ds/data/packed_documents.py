"""Packed documents in a sample (`--reset-position-ids`, `--reset-attention-mask`): each token's position in its
own document and which document it belongs to, from the end-of-document tokens of the sample's input tokens.

Upstream's rule (Megatron-DeepSpeed's `get_ltor_masks_and_position_ids`, megatron-core's
`_get_ltor_masks_and_position_ids`; the two agree, row by row): at an end-of-document token at index i, the
positions of the tokens after it restart at 0 (`--reset-position-ids`), and no token after it attends to a
token at index <= i (`--reset-attention-mask`). The end-of-document token itself belongs to the document it ends
(position and attention alike); one at the last index changes nothing. Both are causal functions of the tokens,
so a sample cut to a prefix (the legacy curriculum) gets the prefix of its full sample's values.

A micro-batch then enters the model as the tuple (tokens, position_ids, document_ids), each (b, s) int64, and
the pipeline carries the two id tensors beside the hidden states (`megatron_ds.model.documents`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PackedDocuments:
    """What a run's micro-batches carry for packed documents."""

    eod: int
    """The tokenizer's end-of-document id (`tokenizer.eod`, as upstream)."""
    reset_position_ids: bool
    """Positions restart after each end-of-document token; else 0..s-1."""
    reset_attention_mask: bool
    """Document ids count the end-of-document tokens before each token; else all 0 (the layers then keep SDPA's
    causal path and never read them)."""

    def structure(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(position_ids, document_ids) of input tokens (b, s), each (b, s) int64."""
        return document_structure(tokens, self.eod, self.reset_position_ids, self.reset_attention_mask)

    def batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Micro-batches `(tokens, labels)` as `((tokens, position_ids, document_ids), labels)`."""
        for inputs, labels in batches:
            tokens = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
            yield (tokens, *self.structure(tokens)), labels


def document_structure(
    tokens: torch.Tensor, eod: int, reset_position_ids: bool, reset_attention_mask: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids, document_ids) (b, s) int64 of input tokens (b, s) (module docstring)."""
    b, s = tokens.shape
    index = torch.arange(s, dtype=torch.int64, device=tokens.device).expand(b, s)
    is_eod = (tokens == eod).long()
    # a token's document: the end-of-document tokens strictly before it (its own, if it is one, ends its document)
    document = torch.cumsum(is_eod, dim=1) - is_eod
    positions = index.clone()
    if reset_position_ids:
        # where the token's document starts: one past the last end-of-document token before it, else 0
        starts = torch.where(is_eod.bool(), index + 1, torch.zeros_like(index))
        starts = torch.cummax(starts, dim=1).values
        starts = torch.cat([torch.zeros_like(starts[:, :1]), starts[:, :-1]], dim=1)
        positions = index - starts
    return positions, document if reset_attention_mask else torch.zeros_like(document)
