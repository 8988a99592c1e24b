"""Every micro-batch's token ids against the vocabulary, before the model sees them.

A corpus written with another tokenizer holds ids the embedding has no row for (an `IndexError` traceback at
the first forward), or ids in its `--make-vocab-size-divisible-by` padding rows (silently trained on). The
check is one min and max per micro-batch in the process that feeds the engine (not in a DataLoader worker,
whose exception would come back wrapped in its traceback); a bad id is a one-line `DataError` naming the
corpus, the sample, the id, the vocabulary and the fix.

Under torch.distributed only some ranks read a given sample, and one rank raising inside the engine's step
strands the others in its communication (a traceback from the closed connection). There the error is handed
to `on_bad` instead, the micro-batch goes on with the bad samples' ids set to 0 and their loss masked, and
the loop stops every rank at once after the step (`training.run_data.BadData`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_ds.data import DataError


@dataclass(frozen=True)
class Vocabulary:
    """The ids a sample may hold: [0, size)."""

    size: int
    """The unpadded vocabulary: `--vocab-size`, else the tokenizer's size."""
    source: str
    """Where it comes from, for the message (`--tokenizer-type GPT2BPETokenizer`, `--vocab-size 900`)."""
    on_bad: Callable[[DataError], None] | None = None
    """None: a bad id raises its DataError at once. Else it is called with it and the batch goes on harmless."""


def checked_batches(
    batches: Iterable[Any], index_lists: Iterable[Sequence[int]], dataset: Any, vocabulary: Vocabulary
) -> Iterator[Any]:
    """`batches` (`(tokens, (labels, loss_mask))`, the samples of each list of `index_lists`), each checked."""
    for batch, indices in zip(batches, index_lists):
        tokens, (labels, loss_mask) = batch
        ids = torch.cat([tokens, labels[:, -1:]], dim=1)  # the sample's seq_length + 1 ids
        if int(ids.min()) >= 0 and int(ids.max()) < vocabulary.size:
            yield batch
            continue
        rows = ((ids < 0) | (ids >= vocabulary.size)).any(dim=1)
        row = int(rows.nonzero()[0])
        error = _bad_id(dataset, indices[row], ids[row], vocabulary)
        if vocabulary.on_bad is None:
            raise error
        vocabulary.on_bad(error)
        tokens, labels, loss_mask = tokens.clone(), labels.clone(), loss_mask.clone()
        tokens[rows], labels[rows], loss_mask[rows] = 0, 0, 0
        yield tokens, (labels, loss_mask)


def check_sample(dataset: Any, index: int, ids: torch.Tensor, vocabulary: Vocabulary) -> None:
    """One sample's ids (`tools/show_samples.py`'s rows) against the vocabulary: the training's DataError if not."""
    if int(ids.min()) < 0 or int(ids.max()) >= vocabulary.size:
        raise _bad_id(dataset, index, ids, vocabulary)


def _bad_id(dataset: Any, index: int, ids: torch.Tensor, vocabulary: Vocabulary) -> DataError:
    bad = ids[(ids < 0) | (ids >= vocabulary.size)]
    worst = int(bad.max()) if int(bad.max()) >= vocabulary.size else int(bad.min())
    prefix, split = _source(dataset, index)
    where = f"{prefix}: " if prefix else ""
    return DataError(
        f"{where}{split}sample {index} holds token id {worst}, outside the vocabulary's {vocabulary.size} ids "
        f"({vocabulary.source}); the corpus was written with another tokenizer: preprocess it with this one "
        "(tools/preprocess_data.py), or give the tokenizer it was written with"
    )


def _source(dataset: Any, index: int) -> tuple[str | None, str]:
    """(the corpus prefix, 'train ' / 'valid ' / 'test ' or '') of sample `index` of a megatron-core dataset."""
    if hasattr(dataset, "datasets") and hasattr(dataset, "dataset_index"):  # a BlendedDataset
        dataset = dataset.datasets[int(dataset.dataset_index[index])]
    prefix = getattr(getattr(dataset, "dataset", None), "path_prefix", None)
    split = getattr(getattr(dataset, "index_split", None), "name", None)
    return prefix, f"{split} " if split else ""
