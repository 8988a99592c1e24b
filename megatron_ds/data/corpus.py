"""One corpus as megatron-core's low-level `IndexedDataset`, read the way the run asks.

Files whose `.idx` describes the `.bin` exactly (ours, Megatron-LM's, Megatron-DeepSpeed's without
`--append-eod`) are megatron-core's `IndexedDataset` as it is. Megatron-DeepSpeed's `--append-eod`
pairs get the lengths and offsets with each EOD counted (held in memory), unless
`--misaligned-append-eod` asks for the stored ones, which is how Megatron-DeepSpeed reads them.
Importing this module imports megatron-core (seconds): import it where datasets are built.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_ds.data.append_eod import offsets
from megatron_ds.data.indexed import IndexInfo, eod_included_lengths, megatron_indexed_dataset_module, read_index


class EodIncludedIndexedDataset(megatron_indexed_dataset_module().IndexedDataset):  # type: ignore[misc]
    """megatron-core's IndexedDataset over an append-eod pair, each document's EOD included.
    `initialize` also runs when a DataLoader worker unpickles it, so every worker reads the same."""

    def initialize(self, path_prefix: str, *args: Any, **kwargs: Any) -> None:
        super().initialize(path_prefix, *args, **kwargs)
        info = read_index(path_prefix)
        lengths = eod_included_lengths(info)
        # Replaced before any read: _IndexReader.__getitem__'s lru_cache holds nothing yet.
        self.index.sequence_lengths = lengths
        self.index.sequence_pointers = offsets(lengths, np.dtype(info.dtype).itemsize)


def open_corpus(info: IndexInfo, misaligned: bool) -> Any:
    """megatron-core's IndexedDataset of a validated prefix, as the run reads it."""
    if info.eod_id is None or misaligned:
        return megatron_indexed_dataset_module().IndexedDataset(info.prefix, multimodal=False, mmap=True)
    return EodIncludedIndexedDataset(info.prefix, multimodal=False, mmap=True)


def reading(info: IndexInfo, misaligned: bool) -> str:
    """How the corpus is read, for the index-cache key: the same lengths read two ways are two indices."""
    if info.eod_id is None:
        return "as stored"
    return "append-eod as stored (misaligned)" if misaligned else "append-eod with each EOD"
