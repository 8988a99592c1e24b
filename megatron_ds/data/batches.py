"""Pipeline micro-batches from a dataset, in Megatron's sample order: `PretrainingBatchSampler` (each
data-parallel rank's consecutive samples from the consumed count, so a resumed run reads what an uninterrupted
one would), `pipeline_batches` (DeepSpeed's pipeline format, `(tokens, (labels, loss_mask))`, through a torch
DataLoader; repeated passes for `--repeated-dataloader`; every id checked against the vocabulary when asked).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from megatron_ds.data import DataError
from megatron_ds.data.vocab_check import Vocabulary, checked_batches

Batch = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
"""One micro-batch as DeepSpeed's pipeline engine takes it: (tokens, (labels, loss_mask)), each (mbs, s)."""


class PretrainingBatchSampler:
    """Megatron's pretraining sampler: consecutive global samples from `consumed_samples`.

    Each group of mbs * dp consecutive samples is one micro-batch for every data-parallel rank;
    rank d takes samples [d * mbs, (d + 1) * mbs) of the group. An incomplete last group is
    dropped. Starting from the consumed-sample count of a checkpoint resumes the exact order.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ) -> None:
        if micro_batch_size < 1 or data_parallel_size < 1:
            raise ValueError(
                f"micro_batch_size {micro_batch_size} and data_parallel_size {data_parallel_size} must be >= 1"
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is outside [0, {data_parallel_size})")
        if not 0 <= consumed_samples <= total_samples:
            raise DataError(
                f"resume point of {consumed_samples} consumed samples is past the "
                f"dataset's {total_samples} samples; the data was built for fewer "
                f"samples than the checkpoint consumed: raise --train-iters"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    def __len__(self) -> int:
        group = self.micro_batch_size * self.data_parallel_size
        return (self.total_samples - self.consumed_samples) // group

    def __iter__(self) -> Iterator[list[int]]:
        mbs = self.micro_batch_size
        group = mbs * self.data_parallel_size
        offset = self.data_parallel_rank * mbs
        for first in range(self.consumed_samples, self.total_samples - group + 1, group):
            yield list(range(first + offset, first + offset + mbs))


def samples_per_pass(num_samples: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """Samples one pass of `PretrainingBatchSampler` over a dataset yields from its start: whole micro-batches on
    every data-parallel rank (the last incomplete group is dropped, as Megatron's sampler drops it)."""
    group = micro_batch_size * data_parallel_size
    return num_samples // group * group


def collate_pipeline(items: list[dict[str, Any]]) -> Batch:
    """Stack items into DeepSpeed's pipeline format: (tokens, (labels, loss_mask)), each (mbs, s)."""
    tokens = torch.stack([torch.as_tensor(it["tokens"], dtype=torch.int64) for it in items])
    labels = torch.stack([torch.as_tensor(it["labels"], dtype=torch.int64) for it in items])
    loss_mask = torch.stack([torch.as_tensor(it["loss_mask"], dtype=torch.float32) for it in items])
    return tokens, (labels, loss_mask)


def _seed_worker(seed: int, worker_id: int) -> None:
    # Items are deterministic; this only pins any randomness a custom dataset might use.
    np.random.seed((seed + worker_id) % 2**32)
    random.seed(seed + worker_id)
    torch.manual_seed(seed + worker_id)


def pipeline_batches(
    dataset: Any,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    start_sample: int,
    num_workers: int,
    seed: int,
    repeat: bool = False,
    vocabulary: Vocabulary | None = None,
) -> Iterator[Batch]:
    """Micro-batches `(tokens, (labels, loss_mask))` for one data-parallel rank, in Megatron's
    order, starting at global sample `start_sample` (the consumed samples, for exact resume).
    `repeat` (`--repeated-dataloader`): after the last whole micro-batch group, again from sample 0, for ever;
    `start_sample` then counts over the passes, so a resumed run reads what an uninterrupted one would.
    `vocabulary`: every micro-batch's ids are checked against it (`vocab_check`)."""
    if num_workers < 0:
        raise ValueError(f"--num-workers {num_workers} must be >= 0")
    if repeat:
        return _passes(
            dataset,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
            start_sample,
            num_workers,
            seed,
            vocabulary,
        )
    sampler = PretrainingBatchSampler(
        len(dataset), start_sample, micro_batch_size, data_parallel_rank, data_parallel_size
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_pipeline,
        worker_init_fn=functools.partial(_seed_worker, seed) if num_workers else None,
        generator=torch.Generator().manual_seed(seed),
        persistent_workers=num_workers > 0,
    )
    if vocabulary is None:
        return iter(loader)
    return checked_batches(loader, sampler, dataset, vocabulary)  # the sampler gives each batch's sample indices


def _passes(
    dataset: Any,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    start_sample: int,
    num_workers: int,
    seed: int,
    vocabulary: Vocabulary | None,
) -> Iterator[Batch]:
    """The repeated loader: pass after pass over the whole micro-batch groups (as DeepSpeed's RepeatingLoader
    re-iterates Megatron's sampler from its start)."""
    per_pass = samples_per_pass(len(dataset), micro_batch_size, dp_size)
    if per_pass == 0:
        raise DataError(
            f"{len(dataset)} samples are fewer than one micro-batch on each of {dp_size} data-parallel ranks"
        )
    start = start_sample % per_pass
    while True:
        yield from pipeline_batches(
            dataset, micro_batch_size, dp_rank, dp_size, start, num_workers, seed, vocabulary=vocabulary
        )
        start = 0
