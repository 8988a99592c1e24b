"""`TensorParallel`: this rank's place in its tensor-parallel group, passed to every layer spec.

A leaf of the model package, so that `model.tensor_parallel` (the front door that dispatches to
megatron-core only at T > 1) and `model.tensor_parallel_layers` (megatron-core's layers) both use it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group."""

    size: int = 1
    """Tensor-parallel ranks T."""
    rank: int = 0
    """This rank's index among them."""
    group: Any | None = None
    """The torch.distributed group of the T ranks (megatron-core's); None at T=1."""


NO_TENSOR_PARALLEL = TensorParallel()
