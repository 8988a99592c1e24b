"""`TensorParallel`: this rank's place in its tensor-parallel group, passed to every layer spec; and
`UlyssesGroup`: its place in a DeepSpeed-Ulysses group; `SequenceShard`: which part of the sequence
this rank's activations hold (Megatron's sequence parallelism, Ulysses), read by the dropout of
sharded activations and the position embeddings.

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
    sequence_parallel: bool = False
    """Megatron sequence parallelism: between the tensor-parallel regions activations are
    sequence-first (s/T, b, h), this rank's T-th of the sequence (`megatron_ds.model.sequence_parallel`)."""

    @property
    def shard(self) -> SequenceShard:
        """The part of the sequence this rank's activations hold outside the tensor-parallel regions."""
        return SequenceShard(self.size, self.rank, dim=0) if self.sequence_parallel else NO_SHARD


NO_TENSOR_PARALLEL = TensorParallel()


@dataclass(frozen=True)
class UlyssesGroup:
    """This rank's place in its DeepSpeed-Ulysses sequence-parallel group (`megatron_ds.model.ulysses`)."""

    size: int = 1
    """Ranks N that split each sequence (`--ds-sequence-parallel-size`)."""
    rank: int = 0
    group: Any | None = None
    """The torch.distributed group of the N ranks; None at N = 1."""

    @property
    def shard(self) -> SequenceShard:
        """Activations are batch-first (b, s/N, h): this rank's N-th of the sequence."""
        return SequenceShard(self.size, self.rank, dim=1)


NO_ULYSSES = UlyssesGroup()


@dataclass(frozen=True)
class SequenceShard:
    """This rank holds part `rank` of `size` equal parts of the sequence, along dimension `dim` of its
    activations: 0 for Megatron's sequence-first (s/T, b, h), 1 for Ulysses' batch-first (b, s/N, h)."""

    size: int = 1
    rank: int = 0
    dim: int = 1


NO_SHARD = SequenceShard()
