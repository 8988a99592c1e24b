"""`--mock-data`: seeded synthetic GPT samples, without files or megatron-core."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from megatron_ds.config import DataConfig
from megatron_ds.data.splits import parse_split
from megatron_ds.data.tokenizer import NullTokenizer, Tokenizer, check_vocab


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
    # ids below the unpadded vocabulary: rows above it are padding no real sample holds (an import's are zero)
    tokenizer = tokenizer or NullTokenizer(data.unpadded_vocab_size or vocab_size)
    check_vocab(tokenizer, vocab_size)
    # megatron-core's MockGPTDataset builds only the splits of weight > 0 (its split matrix), so `--split 100,0,0`
    # evaluates nothing
    shares = parse_split(data.split)
    splits = [
        MockGPTData(n, seq_length, tokenizer.vocab_size, seed, k) if n > 0 and share > 0 else None
        for k, (n, share) in enumerate(zip(num_samples, shares))
    ]
    return splits[0], splits[1], splits[2]
