"""What travels beside the hidden states when samples hold packed documents (`--reset-position-ids`,
`--reset-attention-mask`; `megatron_ds.data.packed_documents` makes the ids from the tokens).

Contract between stages with either flag: the tuple (activation, position_ids, document_ids), the ids (b, s) int64
of the whole sample (also under Megatron's sequence parallelism, where the activation is this rank's part
(s/T, b, h): attention sees the gathered sequence). DeepSpeed's pipeline engine sends every tensor of the tuple
and sends gradients for its floating-point ones only, so the ids cost 2 x b x s x 8 bytes per micro-batch sent
and nothing in backward. The first stage takes (tokens, position_ids, document_ids) from the data; the final
norm returns the hidden states alone, so the LM head, the loss and everything after are unchanged. Without the
flags a stage takes and returns a tensor, as before.
"""

from __future__ import annotations

from typing import Any

import torch

Ids = tuple[torch.Tensor, ...]
"""() without packed documents, else (position_ids, document_ids)."""


def split(x: Any) -> tuple[torch.Tensor, Ids]:
    """A stage's input -> (the activation, the ids travelling with it)."""
    if isinstance(x, (tuple, list)):
        assert len(x) == 3, f"expected (activation, position_ids, document_ids), got {len(x)} tensors"
        return x[0], (x[1], x[2])
    return x, ()


def join(activation: torch.Tensor, ids: Ids) -> Any:
    """The inverse of `split`: what a layer passes on."""
    return (activation, *ids) if ids else activation


def attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """SDPA's boolean mask (b, 1, s, s), True where query i may attend key j: j <= i in the same document."""
    s = document_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)  # (b, s, s)
    return (same & causal).unsqueeze(1)
