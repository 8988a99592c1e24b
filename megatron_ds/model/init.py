"""Layout-independent initialization: every spec draws its weights from its own generator.

A spec's generator is seeded from (global seed, spec index), so layer i gets the same initial
weights whichever stage builds it, whatever the pipeline size, and whichever rank builds it.
Tensor-parallel shards are cut from the full matrix drawn this way, so T does not matter either.
"""
from __future__ import annotations

import torch

_SEED_STRIDE = 1_000_003  # a prime larger than any spec count: (seed, idx) pairs never collide


def spec_seed(seed: int, spec_index: int) -> int:
    """The init seed of spec `spec_index` under the run's `--seed`."""
    return seed * _SEED_STRIDE + spec_index


def init_generator(init_seed: int) -> torch.Generator:
    """A CPU generator for drawing one spec's initial weights."""
    return torch.Generator(device="cpu").manual_seed(init_seed)


@torch.no_grad()
def normal_(tensor: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    """Fill `tensor` from N(0, std^2) drawn on the CPU (identical on every device)."""
    values = torch.empty(tensor.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
    return tensor.copy_(values)
