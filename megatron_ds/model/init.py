"""Layout-independent initialization: every spec draws its weights from its own generator.

A spec's generator is seeded from (global seed, spec index), so layer i gets the same initial
weights whichever stage builds it, whatever the pipeline size, and whichever rank builds it.
Tensor-parallel shards are cut from the full matrix drawn this way (`shard`, `shard_fused`), so
the tensor-parallel size does not matter either: gathering the shards gives the T=1 matrix.

A model whose weights come from elsewhere (a checkpoint) is built under `torch.device("meta")`, which draws
nothing from any generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_SEED_STRIDE = 1_000_003  # a prime larger than any spec count: (seed, idx) pairs never collide
_DROPOUT_STREAMS_PER_SPEC = 4096  # stream 0: replicated activations; 1 + r: tensor rank r's own


def spec_seed(seed: int, spec_index: int) -> int:
    """The init seed of spec `spec_index` under the run's `--seed`."""
    return seed * _SEED_STRIDE + spec_index


def dropout_seed(init_seed: int, tensor_parallel_rank: int | None = None) -> int:
    """Seed of a spec's dropout stream.

    `tensor_parallel_rank=None`: the stream for activations every tensor rank holds in full
    (the same on all tensor ranks, and the same as at T=1). An int r: the stream for
    activations split over tensor ranks (attention probabilities of rank r's heads).
    """
    offset = 0 if tensor_parallel_rank is None else 1 + tensor_parallel_rank
    assert offset < _DROPOUT_STREAMS_PER_SPEC, tensor_parallel_rank
    return (init_seed * _DROPOUT_STREAMS_PER_SPEC + offset) % 2**63


def init_generator(init_seed: int) -> torch.Generator:
    """A CPU generator for drawing one spec's initial weights."""
    return torch.Generator(device="cpu").manual_seed(init_seed)


def draw_normal(shape: Sequence[int], std: float, generator: torch.Generator) -> torch.Tensor:
    """A float32 CPU tensor from N(0, std^2) (identical on every device)."""
    return torch.empty(tuple(shape), dtype=torch.float32).normal_(0.0, std, generator=generator)


@torch.no_grad()
def normal_(tensor: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    """Fill `tensor` from N(0, std^2) drawn on the CPU (identical on every device)."""
    return tensor.copy_(draw_normal(tensor.shape, std, generator))


def shard(full: torch.Tensor, dim: int, num_shards: int, index: int) -> torch.Tensor:
    """Contiguous block `index` of `num_shards` along `dim` (a column- or row-parallel cut)."""
    assert full.shape[dim] % num_shards == 0, (tuple(full.shape), dim, num_shards)
    return full.chunk(num_shards, dim=dim)[index]


def shard_fused(full: torch.Tensor, row_parts: Sequence[int], num_shards: int, index: int) -> torch.Tensor:
    """Rank `index`'s rows of a weight (rows, in) or bias (rows,) whose rows are fused parts.

    The full rows are the parts `row_parts` one after the other (q, k, v of a QKV projection;
    gate and up of a SwiGLU fc1). Each part is cut into `num_shards` contiguous blocks and shard r
    is block r of every part, in part order: a rank's local output has the T=1 structure with
    every part T times smaller.
    """
    assert sum(row_parts) == full.shape[0], (tuple(full.shape), tuple(row_parts))
    parts = full.split(list(row_parts), dim=0)
    return torch.cat([shard(part, 0, num_shards, index) for part in parts]).contiguous()


def gather_fused(shards: Sequence[torch.Tensor], row_parts: Sequence[int]) -> torch.Tensor:
    """Inverse of `shard_fused`: the full weight or bias from every rank's shard."""
    local = [n // len(shards) for n in row_parts]
    pieces = [s.split(local, dim=0) for s in shards]  # [rank][part]
    return torch.cat([pieces[r][i] for i in range(len(row_parts)) for r in range(len(shards))])


def qkv_row_parts(rows: int, num_heads: int, num_kv_heads: int | None = None) -> tuple[int, int, int]:
    """Rows of q, k and v in a fused QKV of `rows` = (nh + 2 kv) * hd rows."""
    kv = num_kv_heads or num_heads
    head_dim = rows // (num_heads + 2 * kv)
    assert head_dim * (num_heads + 2 * kv) == rows, (rows, num_heads, kv)
    return num_heads * head_dim, kv * head_dim, kv * head_dim


def shard_qkv(
    full: torch.Tensor, num_heads: int, num_shards: int, index: int, num_kv_heads: int | None = None
) -> torch.Tensor:
    """Rank `index`'s rows of a fused QKV weight ((nh + 2 kv) hd, h) or bias ((nh + 2 kv) hd,).

    The full rows are all q heads (nh, hd), then all k heads (kv, hd), then all v heads (kv, hd);
    kv = nh unless grouped-query attention. Shard r keeps q heads [r*nh/T, (r+1)*nh/T) and the
    k, v heads [r*kv/T, (r+1)*kv/T) of exactly their groups, in the same q, k, v order, so a rank's
    attention code is the T=1 code with nh/T and kv/T heads.
    """
    assert num_heads % num_shards == 0 and (num_kv_heads or num_heads) % num_shards == 0, (num_heads, num_shards)
    return shard_fused(full, qkv_row_parts(full.shape[0], num_heads, num_kv_heads), num_shards, index)


def gather_qkv(shards: Sequence[torch.Tensor], num_heads: int, num_kv_heads: int | None = None) -> torch.Tensor:
    """Inverse of `shard_qkv`: the full fused QKV weight or bias from every rank's shard."""
    rows = shards[0].shape[0] * len(shards)
    return gather_fused(shards, qkv_row_parts(rows, num_heads, num_kv_heads))
