"""Sliding-window attention: on a layer with a window (`ModelConfig.layer_windows`) the query at position i attends
the keys i - left .. i, left + 1 of them, itself included.

The meaning is Megatron-LM's `--window-size LEFT,0` (megatron-core's `get_sliding_window_causal_mask`, Transformer
Engine's and flash-attention's `window_size=(left, 0)`), and Hugging Face's `sliding_window` W is LEFT + 1
(transformers' `sliding_window_overlay`: key k is seen by query q when q - W < k <= q). With packed documents
(`--reset-attention-mask`) a query sees the keys that are both in its window and in its document.

Training runs the queries in chunks of `chunk_size(left)` rows, each against the keys its rows can see (from
`left` before its first row to its last row) under the band mask, so a layer computes about s x (chunk + left)
scores instead of s^2 (torch's SDPA has no window argument; its flash kernel takes no mask, so each chunk runs its
memory-efficient or math kernel); `computed_pairs` counts them exactly (what the compute model counts for this
code), `band_pairs` the pairs the window itself holds (what a windowed flash kernel, Transformer Engine's or
flash-attention's `window_size`, computes). Importing this module loads no torch (the functions
that run attention import it), so the estimate layer counts with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MIN_CHUNK = 32
"""The fewest query rows per chunk: tiny windows would otherwise cost one kernel per few tokens."""
CHUNKS_PER_WINDOW = 8
"""Chunks of rows per window length: each row's chunk computes (chunk + left) scores for the window's left + 1,
so 1/8 more than the band for windows over 8 x MIN_CHUNK tokens, in s / chunk kernel calls."""


def chunk_size(left: int) -> int:
    """Query rows per chunk: an eighth of the window's keys (left + 1), at least MIN_CHUNK."""
    return max(-(-(left + 1) // CHUNKS_PER_WINDOW), MIN_CHUNK)


def effective(left: int | None, seq: int) -> int | None:
    """The window a sequence of `seq` tokens is attended with: None (the plain causal attention, which computes the
    same) when the window holds every earlier key."""
    return None if left is None or left + 1 >= seq else left


def chunks(seq: int, left: int) -> Iterator[tuple[int, int, int]]:
    """(first query, end of the queries, first key) of each chunk; every chunk's keys end where its queries do."""
    step = chunk_size(left)
    for start in range(0, seq, step):
        yield start, min(start + step, seq), max(0, start - left)


def computed_pairs(seq: int, left: int | None) -> int:
    """Query-key scores one head of one sample computes in training: the chunks' rectangles (s^2 without a window,
    the full-square count of plain attention)."""
    left = effective(left, seq)
    if left is None:
        return seq * seq
    return sum((end - start) * (end - first_key) for start, end, first_key in chunks(seq, left))


def chunk_keys(seq: int, left: int) -> int:
    """Keys summed over the chunks (each chunk's slice of k and v; what the CPU math kernel copies per chunk)."""
    return sum(end - first_key for _, end, first_key in chunks(seq, left))


def largest_chunk_pairs(seq: int, left: int) -> int:
    """Scores of the largest chunk (its probabilities' gradient is the math path's backward peak)."""
    return max((end - start) * (end - first_key) for start, end, first_key in chunks(seq, left))


def band_pairs(seq: int, left: int | None) -> int:
    """Query-key pairs the (causal) window holds for one head and sample: query i sees min(i, left) + 1 keys;
    without a window the causal triangle s(s + 1)/2."""
    left = effective(left, seq)
    if left is None:
        return seq * (seq + 1) // 2
    keys = left + 1
    return keys * (keys + 1) // 2 + (seq - keys) * keys


def visible(
    first_query: int, num_queries: int, first_key: int, num_keys: int, left: int, device: object
) -> torch.Tensor:
    """SDPA's boolean mask (queries, keys), True where the query at position first_query + i sees the key at
    first_key + j: key <= query and key >= query - left."""
    import torch

    q = torch.arange(first_query, first_query + num_queries, device=device).unsqueeze(1)
    k = torch.arange(first_key, first_key + num_keys, device=device).unsqueeze(0)
    return (k <= q) & (k >= q - left)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    left: int,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Windowed causal attention of (b, heads, s, hd) q, k, v, chunk by chunk (`chunks`); `mask` (b, 1, s, s):
    packed documents' "same document and not later", combined with the window."""
    import torch
    import torch.nn.functional as F

    gqa = {"enable_gqa": True} if enable_gqa else {}
    out = []
    for start, end, first in chunks(q.shape[2], left):
        seen = visible(start, end - start, first, end - first, left, q.device)
        if mask is not None:
            seen = seen & mask[..., start:end, first:end]
        part = F.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, first:end], v[:, :, first:end], attn_mask=seen, dropout_p=dropout_p, **gqa
        )
        out.append(part)
    return torch.cat(out, dim=2)
