"""GPT train/valid/test datasets (megatron-core's `GPTDataset` and `BlendedDataset`); `data.batches` makes their
micro-batches.

Every item is a dict with `tokens` (s,) int64, `labels` (s,) int64 (tokens shifted by one) and
`loss_mask` (s,) float32, plus `position_ids` and, for blends, `dataset_id`.

The datasets are megatron-core's, but which documents each split gets and how many samples each
corpus of a blend gives follow the upstream the command line comes from (`splits`, `--data-upstream`):
megatron-core's mid- and top-level datasets build the same document, sample, shuffle and blending
indices as Megatron-DeepSpeed's given those, so a run sees the same samples in the same order as
its upstream. Each corpus is read as `corpus.open_corpus` says (Megatron-DeepSpeed's `--append-eod`
pairs with each EOD included). Guarded here:
- a split that is read but gets no tokens is an error (megatron-core would loop forever counting
  epochs), except a validation or test split to which Megatron-DeepSpeed's rounding gives no
  documents of any corpus: absent, with a NOTICE, as there; one that nothing reads is not built;
- the index caches are keyed on each corpus's index content and reading, not only on its path;
- megatron-core's `BlendedDataset` calls `torch.distributed.get_rank()` on a cache miss whenever a
  cache path is set, so without a process group its (cheap) blending index is built in memory (and
  megatron-core's warning that it cannot save it is dropped);
- the cache files are written atomically and an unreadable one is rebuilt, or a one-line error
  (`index_cache`).
Under torch.distributed, rank 0 builds first (writing the index caches), then the other ranks,
which read them: the cache directory must be shared by all ranks.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from megatron_ds.config import DataConfig
from megatron_ds.config.data import DATA_UPSTREAMS, DEFAULT_SPLIT
from megatron_ds.data import DataError
from megatron_ds.data.append_eod import notice
from megatron_ds.data.indexed import IndexInfo, megatron_indexed_dataset_module, read_index, read_lengths
from megatron_ds.data.mock_data import build_core_mock, build_mock, mock_tokenizer
from megatron_ds.data.splits import (
    SPLIT_PATH_FLAGS,
    OwnData,
    Part,
    absent_notice,
    absent_splits,
    normalized_weights,
    own_paths_log,
    parse_split,
    plan_own_parts,
    plan_parts,
    split_log,
)
from megatron_ds.data.tokenizer import Tokenizer, check_vocab


def parse_data_path(data_path: Sequence[str], flag: str = "--data-path") -> tuple[list[str], list[float] | None]:
    """`--data-path` (or a per-split path, `flag`) -> (prefixes, weights or None), as Megatron reads it.

    One or more prefixes (no weights: blended by size), or `W1 P1 W2 P2 ...` with every weight a
    positive number.
    """
    items = [s.strip() for s in data_path]
    if not items or not all(items):
        raise DataError(
            f"{flag} {' '.join(data_path) or '(empty)'}: give a prefix, or weights "
            f"and prefixes alternating (0.7 a 0.3 b)"
        )
    weights = [_as_float(s) for s in items[0::2]] if len(items) % 2 == 0 else None
    if weights is None or any(w is None for w in weights):
        numbers = [s for s in items if _looks_like_weight(s)]
        if numbers:
            raise DataError(f"{flag} {_shown(items)}: {_misplaced_weight(items, numbers[0])}")
        return items, None
    bad = [w for w in weights if not (w > 0 and np.isfinite(w))]
    if bad:
        raise DataError(f"{flag} {_shown(items)}: weight {bad[0]} must be a positive number")
    return items[1::2], [float(w) for w in weights]  # type: ignore[misc]


def _shown(items: Sequence[str], most: int = 8) -> str:
    """The value for a message, its first items only when long (a wrong --data-args-path file held a corpus)."""
    return " ".join(items) if len(items) <= most else f"{' '.join(items[:most])} ... ({len(items)} items)"


def _looks_like_weight(item: str) -> bool:
    return _as_float(item) is not None and not os.path.exists(item + ".idx")


def _misplaced_weight(items: Sequence[str], first_number: str) -> str:
    """What is wrong with a list that has weights but does not parse as `W1 P1 W2 P2 ...`: the actual bad item."""
    if _looks_like_weight(items[0]):  # a weighted list was begun
        if len(items) % 2 == 1 and _looks_like_weight(items[-1]):
            return f"weight {items[-1]} has no prefix after it; give weights and prefixes in pairs (0.7 a 0.3 b)"
        for k, item in enumerate(items[0::2], 1):
            if _as_float(item) is None:
                point = _as_float(item.replace(",", "."))
                fix = f"write it {point} (a decimal point)" if point is not None else "give a number before each prefix"
                return f"weight {k}, {item!r}, is not a number; {fix}: weights and prefixes alternate (0.7 a 0.3 b)"
    return f"{first_number!r} looks like a weight, but weights and prefixes must alternate (0.7 a 0.3 b)"


def _as_float(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def plan_data(data: DataConfig, num_samples: Sequence[int]) -> tuple[list[IndexInfo], list[Part | None]]:
    """Validate every corpus and plan the splits (DataError on bad input); no megatron-core, no
    process group. The launch checks and the build both call it."""
    if data.has_split_paths:
        return _plan_own_paths(data, num_samples)
    prefixes, weights = parse_data_path(data.data_path)
    parse_split(data.split)
    infos = [read_index(p) for p in prefixes]
    lengths = [read_lengths(info, data.misaligned_append_eod) for info in infos]
    return infos, plan_parts(prefixes, lengths, weights, data.split, data.data_upstream, num_samples)


def _plan_own_paths(data: DataConfig, num_samples: Sequence[int]) -> tuple[list[IndexInfo], list[Part | None]]:
    """`--train-data-path`, `--valid-data-path`, `--test-data-path`: the corpora of every split in one list (a
    prefix read by two splits is there twice), each part naming its own (`Part.corpora`)."""
    infos: list[IndexInfo] = []
    own: list[OwnData | None] = []
    for flag, path in zip(SPLIT_PATH_FLAGS, data.split_paths):
        if not path:
            own.append(None)
            continue
        prefixes, weights = parse_data_path(path, flag)
        split_infos = [read_index(p, flag) for p in prefixes]
        lengths = tuple(read_lengths(info, data.misaligned_append_eod) for info in split_infos)
        own.append(OwnData(tuple(prefixes), lengths, None if weights is None else tuple(weights), len(infos)))
        infos += split_infos
    return infos, plan_own_parts(own, data.data_upstream, num_samples)


def _dataset_config(data: DataConfig, seq_length: int, seed: int, tokenizer: Tokenizer, mock: bool = False) -> Any:
    megatron_indexed_dataset_module()  # the first megatron-core import, minus its GPU-kernel noise
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        # bookkeeping only: the split and blend are planned here (no blend: megatron-core's mock data)
        blend=None if mock else (list(data.data_path or [p for path in data.split_paths for p in path]), None),
        split=data.split,
        # mock samples are built in memory (the same samples; Megatron-LM would also cache their indices)
        path_to_cache=None if mock else data.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=False,
        mmap_bin_files=data.mmap_bin_files,
    )  # the model builds its own causal mask; saves (s, s) per item


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

    A split that gets no share of `--split`, or of which no samples are asked, comes back as None.
    With `data.mock_data` the samples are megatron-core's `MockGPTDataset`'s under Megatron-LM's data
    rules (whose flag it is), else `MockGPTData` (seeded synthetic tokens); the tokenizer defaults to a
    `NullTokenizer` of the unpadded vocabulary. `is_built_on_rank` (default: every rank) must be
    true on global rank 0. Call on every rank when torch.distributed is initialised: it has a
    barrier. All checks happen before it, so a bad input fails on every rank alike.
    """
    if data.mock_data and data.data_upstream == DATA_UPSTREAMS[1]:
        tokenizer = mock_tokenizer(data, tokenizer, vocab_size)
        config = _dataset_config(data, seq_length, seed, tokenizer, mock=True)
        return build_core_mock(config, num_samples, is_built_on_rank)
    if data.mock_data:
        return build_mock(data, seq_length, seed, num_samples, tokenizer, vocab_size, is_built_on_rank)
    if tokenizer is None:
        raise DataError("--tokenizer-type is required with --data-path (or use --mock-data)")
    check_vocab(tokenizer, vocab_size)
    infos, parts = plan_data(data, num_samples)
    _check_cache_dir(data, [i.prefix for i in infos])
    _report(data, infos, tokenizer, num_samples, parts)
    config = _dataset_config(data, seq_length, seed, tokenizer)
    built = _on_rank_zero_first(lambda: [_build_part(p, infos, data, config) for p in parts], is_built_on_rank)
    return tuple(built) if built is not None else (None, None, None)  # type: ignore[return-value]


def _report(
    data: DataConfig,
    infos: Sequence[IndexInfo],
    tokenizer: Tokenizer,
    num_samples: Sequence[int],
    parts: Sequence[Part | None],
) -> None:
    """The append-eod notices, the document ranges and the splits skipped for want of documents (or of a
    per-split path), once (rank 0)."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    if data.misaligned_append_eod and all(info.eod_id is None for info in infos):
        print(
            "WARNING: --misaligned-append-eod changes nothing: no corpus is Megatron-DeepSpeed's --append-eod layout",
            file=sys.stderr,
            flush=True,
        )
    for info in infos:
        if info.eod_id is not None:
            print(notice(info, data.misaligned_append_eod), flush=True)
            if info.eod_id != tokenizer.eod:
                print(
                    f"WARNING: {info.prefix}.bin ends its documents with token {info.eod_id}, but the "
                    f"tokenizer's end-of-document is {tokenizer.eod}: the files were written with another tokenizer",
                    file=sys.stderr,
                    flush=True,
                )
        if not data.has_split_paths:
            print("\n".join(split_log(info.prefix, info.num_sequences, data.split, data.data_upstream)), flush=True)
    if data.has_split_paths:
        _report_own_paths(data, infos, num_samples, parts)
        return
    prefixes, sizes = [i.prefix for i in infos], [i.num_sequences for i in infos]
    for k in absent_splits(sizes, data.split, data.data_upstream, num_samples):
        print(absent_notice(prefixes, sizes, data.split, k), flush=True)


def _report_own_paths(
    data: DataConfig, infos: Sequence[IndexInfo], num_samples: Sequence[int], parts: Sequence[Part | None]
) -> None:
    """Each split's own corpora (all their documents), and the evaluations skipped for want of a path."""
    if data.split.replace(" ", "") != DEFAULT_SPLIT:
        print(
            f"NOTICE: --split {data.split} is not used: each split reads all the documents of its own path "
            "(Megatron-DeepSpeed ignores it too)",
            flush=True,
        )
    for k, (flag, part) in enumerate(zip(SPLIT_PATH_FLAGS, parts)):
        if part is not None and part.corpora is not None:
            read = [infos[i] for i in part.corpora]
            print(own_paths_log(flag, [i.prefix for i in read], [i.num_sequences for i in read]), flush=True)
        elif k > 0 and not data.split_paths[k] and num_samples[k] > 0:
            skipped = "no validation during or after training" if k == 1 else "no test evaluation at the end"
            print(f"NOTICE: no {flag}: {skipped}, as upstream", flush=True)


def _on_rank_zero_first(build: Callable[[], Any], is_built_on_rank: Callable[[], bool] | None) -> Any:
    """megatron-core's protocol: rank 0 builds (and writes the caches), then the others (reading them)."""
    on_rank = is_built_on_rank or _always
    if not torch.distributed.is_initialized():
        return build()
    rank, result = torch.distributed.get_rank(), None
    if rank == 0 and on_rank():
        result = build()
    torch.distributed.barrier()
    if rank != 0 and on_rank():
        result = build()
    return result


def _build_part(part: Part | None, infos: Sequence[IndexInfo], data: DataConfig, config: Any) -> Any:
    """One split: a GPTDataset per corpus over its planned documents, blended when there are several (or
    when Megatron-DeepSpeed's rules blend one weighted corpus alone)."""
    if part is None:
        return None
    if part.corpora is not None:
        infos = [infos[i] for i in part.corpora]
    weights = part.weights
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.utils import Split

    from megatron_ds.data.corpus import open_corpus, reading
    from megatron_ds.data.index_cache import cache_io, rebuilt_if_damaged

    builds = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0  # writes the caches
    datasets = []
    with cache_io():
        for info, (lo, hi), size in zip(infos, part.ranges, part.sizes):
            # The description (and so the cache file names) records what the indices are built from.
            key = f"{info.prefix} [index {info.fingerprint}, {reading(info, data.misaligned_append_eod)}, documents {lo}:{hi}]"
            documents = np.arange(lo, hi, dtype=np.int32)
            corpus = open_corpus(info, data.misaligned_append_eod)
            build = functools.partial(GPTDataset, corpus, key, documents, size, Split(part.index), config)
            datasets.append(rebuilt_if_damaged(build, builds))
        if weights is None and len(datasets) == 1:
            return datasets[0]
        if config.path_to_cache and not torch.distributed.is_initialized():
            config = copy.copy(config)  # the GPTDataset caches above still went to the cache path
            config.path_to_cache = None
        if weights is None:  # megatron-core: one epoch of each corpus, weighted by its size
            sizes = [len(d) for d in datasets]
            build = functools.partial(BlendedDataset, datasets, sizes, min(part.num_samples, sum(sizes)), config)
        else:
            blend_weights = normalized_weights(weights, data.data_upstream)
            build = functools.partial(BlendedDataset, datasets, blend_weights, part.blend_size, config)
        return rebuilt_if_damaged(build, builds)


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
