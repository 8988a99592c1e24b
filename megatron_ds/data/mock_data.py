"""`--mock-data`: synthetic GPT samples, without files.

Under Megatron-LM's data rules (`--data-upstream`, docs/data.md), whose flag it is, the samples are
Megatron-LM's: megatron-core's `MockGPTDataset` through its `BlendedMegatronDatasetBuilder`, as Megatron-LM's
pretrain_gpt.py builds them (documents of random length holding 1, 2, 3, ... and an EOD; with no blend,
megatron-core splits them 1,1,1 whatever `--split` says). Megatron-DeepSpeed has no mock data: under its rules
the samples are `MockGPTData`'s seeded random tokens, which start without megatron-core (fast smoke tests), and
a NOTICE says so.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from megatron_ds.config import DataConfig
from megatron_ds.data.splits import parse_split
from megatron_ds.data.tokenizer import NullTokenizer, Tokenizer, check_vocab

MDS_RULES_NOTICE = (
    "NOTICE: --mock-data under Megatron-DeepSpeed's data rules (it has no mock data): seeded random tokens "
    "(MockGPTData); --data-upstream megatron-lm gives Megatron-LM's samples (megatron-core's MockGPTDataset)"
)


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


def mock_tokenizer(data: DataConfig, tokenizer: Tokenizer | None, vocab_size: int) -> Tokenizer:
    """The run's tokenizer, or a `NullTokenizer` of the unpadded vocabulary: ids below it (rows above it are
    padding no real sample holds; an import's are zero)."""
    tokenizer = tokenizer or NullTokenizer(data.unpadded_vocab_size or vocab_size)
    check_vocab(tokenizer, vocab_size)
    return tokenizer


def build_core_mock(
    config: Any, num_samples: tuple[int, int, int], is_built_on_rank: Callable[[], bool] | None
) -> tuple[Any, Any, Any]:
    """Megatron-LM's `--mock-data` samples: megatron-core's builder over `MockGPTDataset` with `config` (a
    GPTDatasetConfig without a blend, hence mock). Collective when torch.distributed is initialised (the
    builder's own rank-0-first barriers): call it on every rank."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    assert config.mock, config
    built = BlendedMegatronDatasetBuilder(MockGPTDataset, list(num_samples), is_built_on_rank or _always, config)
    quiet = _NoCacheWarning()  # the indices are built in memory on purpose: a warning per split is noise
    logger = logging.getLogger("megatron.core.datasets.gpt_dataset")
    logger.addFilter(quiet)
    try:
        train, valid, test = built.build()
    finally:
        logger.removeFilter(quiet)
    return train, valid, test


class _NoCacheWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "indexes because path_to_cache is None" not in record.getMessage()


def _always() -> bool:
    return True


def build_mock(
    data: DataConfig,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    tokenizer: Tokenizer | None,
    vocab_size: int,
    is_built_on_rank: Callable[[], bool] | None,
) -> tuple[Any, Any, Any]:
    del is_built_on_rank  # nothing is cached: every rank builds its own (instantly)
    if data.data_path:  # (a per-split path beside --mock-data is refused by DataConfig)
        warnings.warn(f"--data-path {' '.join(data.data_path)} is ignored with --mock-data", stacklevel=2)
    tokenizer = mock_tokenizer(data, tokenizer, vocab_size)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(MDS_RULES_NOTICE, flush=True)
    # megatron-core's MockGPTDataset builds only the splits of weight > 0 (its split matrix), so `--split 100,0,0`
    # evaluates nothing
    shares = parse_split(data.split)
    splits = [
        MockGPTData(n, seq_length, tokenizer.vocab_size, seed, k) if n > 0 and share > 0 else None
        for k, (n, share) in enumerate(zip(num_samples, shares))
    ]
    return splits[0], splits[1], splits[2]
