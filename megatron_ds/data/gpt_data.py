"""GPT train/valid/test datasets (megatron-core's `GPTDataset`) and pipeline micro-batches.

Every item is a dict with `tokens` (s,) int64, `labels` (s,) int64 (tokens shifted by one) and
`loss_mask` (s,) float32, plus `position_ids` and, for blends, `dataset_id`.

Two megatron-core traps are guarded here (both reproduced on megatron-core 0.16.1, CPU):
- a split that receives no document makes `GPTDataset` loop forever counting epochs, so split
  sizes are checked per corpus before anything is built;
- `BlendedDataset` calls `torch.distributed.get_rank()` on a cache miss whenever a cache path is
  set, so without a process group its (cheap) blending index is built in memory instead.
Under torch.distributed, megatron-core's builder builds on rank 0 first (writing the index caches),
then on the other ranks, which read them: the cache directory must be shared by all ranks.
"""

from __future__ import annotations

import copy
import functools
import os
import random
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from megatron_ds.config import DataConfig
from megatron_ds.data import DataError
from megatron_ds.data.indexed import IndexInfo, megatron_indexed_dataset_module, read_index
from megatron_ds.data.tokenizer import NullTokenizer, Tokenizer

SPLIT_NAMES = ("train", "validation", "test")
Batch = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """`--data-path` -> (prefixes, weights or None), as Megatron reads it.

    One or more prefixes (no weights: blended by size), or `W1 P1 W2 P2 ...` with every weight a
    positive number.
    """
    items = [s.strip() for s in data_path]
    if not items or not all(items):
        raise DataError(
            f"--data-path {' '.join(data_path) or '(empty)'}: give a prefix, or weights "
            f"and prefixes alternating (0.7 a 0.3 b)"
        )
    weights = [_as_float(s) for s in items[0::2]] if len(items) % 2 == 0 else None
    if weights is None or any(w is None for w in weights):
        numbers = [s for s in items if _as_float(s) is not None and not os.path.exists(s + ".idx")]
        if numbers:
            raise DataError(
                f"--data-path {' '.join(items)}: {numbers[0]!r} looks like a weight, but "
                f"weights and prefixes must alternate (0.7 a 0.3 b)"
            )
        return items, None
    bad = [w for w in weights if not (w > 0 and np.isfinite(w))]
    if bad:
        raise DataError(f"--data-path {' '.join(items)}: weight {bad[0]} must be a positive number")
    return items[1::2], [float(w) for w in weights]  # type: ignore[misc]


def _as_float(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def parse_split(split: str) -> list[float]:
    """`--split 969,30,1` -> normalised train/valid/test fractions."""
    try:
        values = [float(p) for p in re.split(r"[,/]", split.strip())]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(v < 0 or not np.isfinite(v) for v in values) or sum(values) <= 0:
        raise DataError(
            f"--split {split}: expected up to three comma-separated non-negative "
            f"weights with a positive sum, e.g. 969,30,1"
        )
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]


def split_ranges(num_documents: int, split: str) -> list[tuple[int, int] | None]:
    """Document range [begin, end) of each split, with megatron-core's rounding; None if weight 0."""
    bounds = np.cumsum([0.0, *parse_split(split)])
    ranges: list[tuple[int, int] | None] = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        ranges.append(None if hi <= lo else (int(round(lo * num_documents)), int(round(hi * num_documents))))
    return ranges


def check_splits(infos: Sequence[IndexInfo], split: str) -> None:
    """Every split with a positive weight must get at least one non-empty document of every
    corpus; megatron-core would otherwise loop forever looking for tokens."""
    for info in infos:
        for name, rng in zip(SPLIT_NAMES, split_ranges(info.num_sequences, split)):
            if rng is None:
                continue
            num_tokens = int(info.sequence_lengths[rng[0] : rng[1]].sum(dtype=np.int64))
            if num_tokens == 0:
                raise DataError(
                    f"--split {split}: corpus {info.prefix} has {info.num_sequences} documents, so "
                    f"its {name} split gets {rng[1] - rng[0]} documents and 0 tokens (megatron-core "
                    f"would loop forever); give {name} a larger share or 0, or add documents"
                )


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """The embedding must have a row for every token id the tokenizer can produce."""
    if tokenizer.vocab_size > vocab_size:
        source = (
            getattr(tokenizer, "model_file", None) or getattr(tokenizer, "vocab_file", None) or type(tokenizer).__name__
        )
        raise DataError(
            f"tokenizer model {source} has {tokenizer.vocab_size} tokens but "
            f"--vocab-size is {vocab_size}; raise --vocab-size to at least "
            f"{tokenizer.vocab_size} or use a smaller tokenizer"
        )


def _dataset_config(
    data: DataConfig,
    seq_length: int,
    seed: int,
    tokenizer: Tokenizer,
    blend: tuple[list[str], list[float] | None] | None,
) -> Any:
    megatron_indexed_dataset_module()  # the first megatron-core import, minus its GPU-kernel noise
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=data.split if blend else None,
        path_to_cache=data.data_cache_path if blend else None,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=False,
        mmap_bin_files=data.mmap_bin_files,
    )  # the model builds its own causal mask; saves (s, s) per item


def _builder_class() -> type:
    """megatron-core's builder, minus its crash on a blend cache miss without a process group."""
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    class Builder(BlendedMegatronDatasetBuilder):
        @staticmethod
        def build_generic_dataset(cls: Any, is_built_on_rank: Callable, synchronize_ranks: bool, *args: Any) -> Any:
            config = args[-1]
            if cls is BlendedDataset and config.path_to_cache and not torch.distributed.is_initialized():
                config = copy.copy(config)  # the GPTDataset caches still go to the cache path
                config.path_to_cache = None
                args = (*args[:-1], config)
            return BlendedMegatronDatasetBuilder.build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args)

    return Builder


def build_gpt_datasets(
    data: DataConfig,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    tokenizer: Tokenizer | None,
    vocab_size: int,
    is_built_on_rank: Callable[[], bool] | None = None,
) -> tuple[Any, Any, Any]:
    """(train, valid, test) datasets of at least `num_samples` samples each.

    A split whose `--split` weight is 0 comes back as None. With `data.mock_data` the samples are
    `MockGPTData` (seeded synthetic tokens; the tokenizer defaults to a `NullTokenizer(vocab_size)`;
    a split with no samples asked for comes back as None). `is_built_on_rank` (default: every rank) must be true on
    global rank 0. Call on every rank when torch.distributed is initialised: it has barriers.
    All checks happen before the first barrier, so a bad input fails on every rank alike.
    """
    if data.mock_data:
        return _build_mock(data, seq_length, seed, num_samples, tokenizer, vocab_size, is_built_on_rank)
    if tokenizer is None:
        raise DataError("--tokenizer-type is required with --data-path (or use --mock-data)")
    check_vocab(tokenizer, vocab_size)
    prefixes, weights = parse_data_path(data.data_path)
    parse_split(data.split)
    check_splits([read_index(p) for p in prefixes], data.split)
    _check_cache_dir(data, prefixes)
    config = _dataset_config(data, seq_length, seed, tokenizer, (prefixes, weights))
    from megatron.core.datasets.gpt_dataset import GPTDataset

    builder = _builder_class()(GPTDataset, list(num_samples), is_built_on_rank or _always, config)
    train, valid, test = builder.build()
    return train, valid, test


class MockGPTData(torch.utils.data.Dataset):
    """`--mock-data`: deterministic synthetic token sequences, as Megatron-LM's mock dataset, but
    the token values themselves follow the seed (megatron-core's MockGPTDataset seeds only the
    order) and nothing is imported from megatron-core, so smoke tests start fast.

    Sample i of split k is drawn from a generator seeded with (seed, k, i): any sample can be read
    in any order, by any worker, with the same result.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, split_index: int) -> None:
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.seed, self.split_index = seed, split_index

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        gen = torch.Generator().manual_seed(((self.seed * 4 + self.split_index) * 1_000_003 + index) % 2**63)
        text = torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=gen)
        return {
            "tokens": text[:-1].clone(),
            "labels": text[1:].clone(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length),
        }


def _build_mock(
    data: DataConfig,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    tokenizer: Tokenizer | None,
    vocab_size: int,
    is_built_on_rank: Callable[[], bool] | None,
) -> tuple[Any, Any, Any]:
    del is_built_on_rank  # nothing is cached: every rank builds its own (instantly)
    if data.data_path:
        warnings.warn(f"--data-path {' '.join(data.data_path)} is ignored with --mock-data", stacklevel=2)
    tokenizer = tokenizer or NullTokenizer(vocab_size)
    check_vocab(tokenizer, vocab_size)
    splits = [
        MockGPTData(n, seq_length, tokenizer.vocab_size, seed, k) if n > 0 else None for k, n in enumerate(num_samples)
    ]
    return splits[0], splits[1], splits[2]


def _always() -> bool:
    return True


def _check_cache_dir(data: DataConfig, prefixes: Sequence[str]) -> None:
    """Fail early (on every rank) when the index cache directory cannot even be created."""
    dirs = (
        [data.data_cache_path] if data.data_cache_path else [os.path.join(p, "cache") for p in prefixes]
    )  # megatron-core's default location
    for d in dirs:
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as err:
            flag = "--data-cache-path" if data.data_cache_path else "index cache directory"
            raise DataError(
                f"{flag} {d}: cannot create it ({err.strerror}); pass --data-cache-path to a writable directory"
            ) from None


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
) -> Iterator[Batch]:
    """Micro-batches `(tokens, (labels, loss_mask))` for one data-parallel rank, in Megatron's
    order, starting at global sample `start_sample` (the consumed samples, for exact resume)."""
    if num_workers < 0:
        raise ValueError(f"--num-workers {num_workers} must be >= 0")
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
    return iter(loader)
