"""Layout-independent initialization: every spec draws its weights from its own generator.

A spec's generator is seeded from (global seed, spec index), so layer i gets the same initial
weights whichever stage builds it, whatever the pipeline size, and whichever rank builds it.
Tensor-parallel shards are cut from the full matrix drawn this way (`shard`, `shard_qkv`), so
the tensor-parallel size does not matter either: gathering the shards gives the T=1 matrix.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

_SEED_STRIDE = 1_000_003  # a prime larger than any spec count: (seed, idx) pairs never collide
_DROPOUT_STREAMS_PER_SPEC = 4096  # stream 0: replicated activations; 1 + r: tensor rank r's own


def spec_seed(seed: int, spec_index: int) -> int:
    """The init seed of spec `spec_index` under the run's `--seed`."""
    return seed * _SEED_STRIDE + spec_index


def dropout_seed(init_seed: int, tensor_parallel_rank: Optional[int] = None) -> int:
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


def shard_qkv(full: torch.Tensor, num_heads: int, num_shards: int, index: int) -> torch.Tensor:
    """Rank `index`'s rows of a fused QKV weight (3h, h) or bias (3h,).

    The full rows are laid out (3, nh, hd): all q heads, then all k, then all v. Shard r
    keeps the q, k and v rows of its own heads [r*nh/T, (r+1)*nh/T), in the same (3, nh/T, hd)
    order, so a rank's attention code is the T=1 code with nh/T heads.
    """
    assert num_heads % num_shards == 0, (num_heads, num_shards)
    rows = full.reshape(3, num_heads, -1, *full.shape[1:])  # (3, nh, hd[, h])
    mine = shard(rows, 1, num_shards, index)  # (3, nh/T, hd[, h])
    return mine.reshape(-1, *full.shape[1:]).contiguous()


def gather_qkv(shards: Sequence[torch.Tensor], num_heads: int) -> torch.Tensor:
    """Inverse of `shard_qkv`: the full (3h, h) weight or (3h,) bias from every rank's shard."""
    local_heads = num_heads // len(shards)
    views = [s.reshape(3, local_heads, -1, *s.shape[1:]) for s in shards]
    full = torch.cat(views, dim=1)  # (3, nh, hd[, h])
    return full.reshape(-1, *shards[0].shape[1:])
