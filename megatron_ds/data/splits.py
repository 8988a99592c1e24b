"""Which documents each split gets and how many samples each corpus of a blend gives, under the
rules of the upstream a command line comes from (`--data-upstream`). Pure Python and numpy.

The two upstreams agree on everything else that decides the samples (the per-corpus document,
sample and shuffle indices, the blending index), so choosing the rules here is what makes a run
see the same samples in the same order as its upstream would:

- Megatron-DeepSpeed (`megatron/data/dataset_utils.py` `get_train_valid_test_split_`) rounds each
  split's share of the documents and moves every boundary by the total rounding error;
  megatron-core (Megatron-LM) rounds the cumulative boundaries. `--split 98,2,0` over 75
  documents trains on [0, 73) there and [0, 74) here.
- A blend asks each corpus for `ceil(n * w * 1.005)` samples in Megatron-DeepSpeed and blends
  their sum; megatron-core asks `ceil(ceil(n * w) * 1.005)` and blends `sum(ceil(n * w))`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_ds.config import DATA_UPSTREAMS, TrainingConfig
from megatron_ds.config.data import SPLIT_PATH_FLAGS, split_fractions, split_message
from megatron_ds.data import DataError

MEGATRON_DEEPSPEED, MEGATRON_LM = DATA_UPSTREAMS
SPLIT_NAMES = ("train", "validation", "test")
BLEND_SURPLUS = 0.005
"""Both upstreams ask each corpus of a blend for 0.5% more samples than its share."""

Range = tuple[int, int]


def parse_split(split: str) -> list[float]:
    """`--split 969,30,1` -> normalised train/valid/test fractions (`config.data.split_fractions`)."""
    fractions = split_fractions(split)
    if fractions is None:
        raise DataError(split_message(split))
    return fractions


def _megatron_deepspeed_bounds(num_documents: int, split: str) -> list[int]:
    """Megatron-DeepSpeed's boundaries: each share rounded, then all moved by the total error."""
    bounds = [0]
    for share in parse_split(split):
        bounds.append(bounds[-1] + int(round(share * float(num_documents))))
    error = bounds[-1] - num_documents
    return [bounds[0], *(b - error for b in bounds[1:])]


def split_ranges(num_documents: int, split: str, upstream: str = MEGATRON_LM) -> list[Range | None]:
    """Document range [begin, end) of each split; None for a split that gets no share.

    megatron-lm: megatron-core's cumulative rounding; a split of weight 0 is None.
    megatron-deepspeed: Megatron-DeepSpeed's rounding; a split with no documents is None (it
    builds no dataset for it), a negative boundary (a split of many tiny shares over very few
    documents, which Megatron-DeepSpeed fails on) is a DataError.
    """
    if upstream == MEGATRON_DEEPSPEED:
        bounds = _megatron_deepspeed_bounds(num_documents, split)
        if min(bounds) < 0:
            raise DataError(
                f"--split {split}: over {num_documents} documents Megatron-DeepSpeed's rounding gives the "
                f"boundaries {bounds} (one below 0, which it fails on); add documents or give fewer parts"
            )
        return _mds_or_none(bounds)
    if upstream != MEGATRON_LM:
        raise ValueError(f"upstream {upstream!r} is not one of {DATA_UPSTREAMS}")
    cumulative = [0.0]
    for share in parse_split(split):
        cumulative.append(cumulative[-1] + share)
    return [
        None if hi <= lo else (int(round(lo * num_documents)), int(round(hi * num_documents)))
        for lo, hi in zip(cumulative[:-1], cumulative[1:])
    ]


def blend_sizes(weights: Sequence[float], num_samples: int, upstream: str) -> tuple[list[int], int]:
    """(samples asked of each corpus, samples of the blend) for one split of a weighted blend."""
    if upstream == MEGATRON_DEEPSPEED:  # dataset_utils.get_datasets_weights_and_num_samples
        total = 0.0
        for w in weights:
            total += w
        per_corpus = [int(math.ceil(num_samples * (w / total) * (1 + BLEND_SURPLUS))) for w in weights]
        return per_corpus, sum(per_corpus)
    targets = [int(math.ceil(num_samples * w)) for w in normalized_weights(weights, upstream)]
    return [int(math.ceil(t * (1 + BLEND_SURPLUS))) for t in targets], sum(targets)


def normalized_weights(weights: Sequence[float], upstream: str) -> list[float]:
    """Blend weights summing to 1, in each upstream's arithmetic (a Python loop; numpy's sum)."""
    if upstream == MEGATRON_DEEPSPEED:
        total = 0.0
        for w in weights:
            total += w
        return [w / total for w in weights]
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


@dataclass(frozen=True)
class Part:
    """One split of the run's data (train, validation or test) over every corpus."""

    index: int
    """0 train, 1 validation, 2 test."""
    ranges: tuple[Range, ...]
    """Document range of each corpus."""
    sizes: tuple[int | None, ...]
    """Samples asked of each corpus (None: one epoch, for a blend without weights)."""
    blend_size: int | None
    """Samples of the weighted blend; None for one corpus without a weight, or a blend by size."""
    num_samples: int
    """Samples the run asks of this split."""
    weights: tuple[float, ...] | None = None
    """The blend's weights as given (None: one corpus read as it is, or a blend by size)."""
    corpora: tuple[int, ...] | None = None
    """Which of the planned corpora this split reads (its own path's, `plan_own_parts`); None: all of them."""

    @property
    def name(self) -> str:
        return SPLIT_NAMES[self.index]


def plan_parts(
    prefixes: Sequence[str],
    lengths: Sequence[np.ndarray],
    weights: Sequence[float] | None,
    split: str,
    upstream: str,
    num_samples: Sequence[int],
) -> list[Part | None]:
    """Each split's documents and sample counts; None for a split nothing reads, that has no share, or
    that is absent (`absent_splits`).

    Training with no share of `--split` is a DataError. A split with a share but no tokens in some
    corpus is a DataError only if it is read (a positive `num_samples`) and not absent: megatron-core
    would loop forever, Megatron-DeepSpeed fails on a blend that lacks it in some corpora only.
    """
    shares = parse_split(split)
    if shares[0] <= 0 and num_samples[0] > 0:
        raise DataError(
            f"--split {split} gives training no documents, but training reads {num_samples[0]} samples: give train "
            "a share"
        )
    ranges = [split_ranges(len(n), split, upstream) for n in lengths]
    absent = absent_splits([len(n) for n in lengths], split, upstream, num_samples)
    parts: list[Part | None] = []
    for k, name in enumerate(SPLIT_NAMES):
        if shares[k] <= 0 or num_samples[k] <= 0 or k in absent:
            parts.append(None)
            continue
        for prefix, n, r in zip(prefixes, lengths, ranges):
            lo, hi = r[k] or (0, 0)
            if r[k] is None or int(np.sum(n[lo:hi], dtype=np.int64)) == 0:
                raise _empty_part_error(prefix, len(n), split, upstream, name, r[k], num_samples[k])
        sizes, blend = _part_sizes(weights, len(prefixes), num_samples[k], upstream)
        w = None if weights is None else tuple(weights)
        parts.append(Part(k, tuple(r[k] for r in ranges), tuple(sizes), blend, num_samples[k], w))  # type: ignore[misc]
    return parts


def _part_sizes(
    weights: Sequence[float] | None, count: int, num_samples: int, upstream: str
) -> tuple[Sequence[int | None], int | None]:
    """A split's samples per corpus and its blend's size: one corpus without a weight gives what the run asks;
    several without weights are blended one epoch each, by their sizes (megatron-core's rule); weighted ones as
    `blend_sizes`."""
    if weights is None and count == 1:
        return [num_samples], None
    if weights is None:
        return [None] * count, None
    return blend_sizes(weights, num_samples, upstream)


@dataclass(frozen=True)
class OwnData:
    """The corpora of one split's own path (`--train-data-path` ...), as parsed."""

    prefixes: tuple[str, ...]
    lengths: tuple[np.ndarray, ...]
    """Each corpus's document lengths."""
    weights: tuple[float, ...] | None
    first: int
    """Where its corpora start in the list of every split's corpora (`Part.corpora`)."""


def plan_own_parts(own: Sequence[OwnData | None], upstream: str, num_samples: Sequence[int]) -> list[Part | None]:
    """Each split read whole from its own path(s) (`--train-data-path`, `--valid-data-path`, `--test-data-path`),
    `--split` unused; None for a split without a path or that nothing reads.

    Every document of each corpus, as both upstreams read them. A weighted blend's parts are sized as `--data-path`'s
    (`blend_sizes`). The rules differ in one place: megatron-core reads a single prefix as it is, its weight
    ignored, where Megatron-DeepSpeed blends it alone (`1.0 a` asks `ceil(n * 1.005)` samples of it). Training
    without a path is a DataError when the run trains; a corpus without tokens, when its split is read.
    """
    if own[0] is None and num_samples[0] > 0:
        raise DataError(
            f"no --train-data-path, but training reads {num_samples[0]} samples: give the training data with "
            "--train-data-path (or --data-path with --split)"
        )
    parts: list[Part | None] = []
    for k, split in enumerate(own):
        if split is None or num_samples[k] <= 0:
            parts.append(None)
            continue
        for prefix, n in zip(split.prefixes, split.lengths):
            if int(np.sum(n, dtype=np.int64)) == 0:
                reader = "training" if k == 0 else "evaluation"
                raise DataError(
                    f"{SPLIT_PATH_FLAGS[k]} {prefix}: its {len(n)} documents hold no tokens, but {reader} reads "
                    f"{num_samples[k]} {SPLIT_NAMES[k]} samples; give a corpus with tokens"
                )
        weights = split.weights
        if len(split.prefixes) == 1 and upstream == MEGATRON_LM:
            weights = None  # megatron-core reads one prefix as it is, its weight ignored
        sizes, blend = _part_sizes(weights, len(split.prefixes), num_samples[k], upstream)
        ranges = tuple((0, len(n)) for n in split.lengths)
        corpora = tuple(range(split.first, split.first + len(split.prefixes)))
        parts.append(Part(k, ranges, tuple(sizes), blend, num_samples[k], weights, corpora))  # type: ignore[arg-type]
    return parts


def own_paths_log(flag: str, prefixes: Sequence[str], num_documents: Sequence[int]) -> str:
    """The documents a split reads from its own path(s)."""
    corpora = ", ".join(f"{p}: all {n} documents [0, {n})" for p, n in zip(prefixes, num_documents))
    return f"> {flag}: {corpora}"


def check_train_share(split: str, train_iters: int) -> None:
    """DataError when `--split` gives training no share but the run trains (upstream would skip training, or
    reach the first step without data): said before anything starts."""
    if train_iters > 0 and parse_split(split)[0] <= 0:
        raise DataError(
            f"--split {split} gives training no documents, but the run trains {train_iters} iterations "
            f"(--train-iters {train_iters}): give train a share, e.g. --split 969,30,1"
        )


def absent_splits(num_documents: Sequence[int], split: str, upstream: str, num_samples: Sequence[int]) -> list[int]:
    """The validation and test splits (1, 2) that are read and have a share of `--split`, but to which
    Megatron-DeepSpeed's rounding gives no documents of any corpus: absent, as there (its gpt_dataset.py
    builds no dataset for an empty range, and its training.py then skips that evaluation). None under
    megatron-core's rules (Megatron-LM loops forever on such a split) nor for training."""
    if upstream != MEGATRON_DEEPSPEED:
        return []
    shares = parse_split(split)
    ranges = [split_ranges(n, split, upstream) for n in num_documents]
    return [k for k in (1, 2) if shares[k] > 0 and num_samples[k] > 0 and all(r[k] is None for r in ranges)]


def absent_notice(prefixes: Sequence[str], num_documents: Sequence[int], split: str, index: int) -> str:
    """The one line that says an absent split (`absent_splits`) is skipped, and why."""
    name = SPLIT_NAMES[index]
    corpora = (
        f"the {num_documents[0]} documents of {prefixes[0]}"
        if len(prefixes) == 1
        else "any corpus (" + ", ".join(f"{p}: {n} documents" for p, n in zip(prefixes, num_documents)) + ")"
    )
    skipped = "no validation during or after training" if index == 1 else "no test evaluation at the end"
    return (
        f"NOTICE: --split {split} gives the {name} split no documents of {corpora} (Megatron-DeepSpeed's "
        f"rounding): it is skipped as Megatron-DeepSpeed skips it, {skipped}; give {name} a larger share or add "
        "documents to evaluate it"
    )


def _empty_part_error(
    prefix: str, num_documents: int, split: str, upstream: str, name: str, rng: Range | None, num_samples: int
) -> DataError:
    docs = "no documents" if rng is None or rng[1] <= rng[0] else f"documents [{rng[0]}, {rng[1]}) but no tokens"
    rounding = "Megatron-DeepSpeed's" if upstream == MEGATRON_DEEPSPEED else "megatron-core's"
    reader, fix = ("training", "") if name == "train" else ("evaluation", ", or --eval-iters 0 to skip it")
    return DataError(
        f"--split {split}: corpus {prefix} has {num_documents} documents, so its {name} split gets {docs} "
        f"({rounding} rounding), but {reader} reads {num_samples} {name} samples; give {name} a larger share "
        f"or add documents{fix}"
    )


def requested_samples(training: TrainingConfig) -> tuple[int, int, int]:
    """Samples each split must provide, as both upstreams' training.py computes them: --train-samples, or every
    training iteration's batch; every evaluation (one per --eval-interval and one at the end) and one test.
    `--skip-train` reads no training sample, so an evaluation-only run needs no training data (upstream builds
    the training set it never reads, when there is one)."""
    gbs, t = training.global_batch_size, training
    evaluations = (t.train_iters // t.eval_interval + 1) * t.eval_iters
    train = t.train_iters * gbs if t.train_samples is None else t.train_samples
    if t.skip_train:
        train = 0
    return train, evaluations * gbs, t.eval_iters * gbs


def _split_matrix(split: str) -> list[tuple[float, float] | None]:
    """megatron-core's split matrix, as it logs it (`Let split_matrix = ...`)."""
    matrix: list[tuple[float, float] | None] = []
    at: float = 0
    for share in parse_split(split):
        matrix.append((at, at + share) if at + share > at else None)
        at = at + share
    return matrix


def _effective(ranges: Sequence[Range | None]) -> list[Range | None]:
    return [r if r is not None and r[1] > r[0] else None for r in ranges]


def split_log(prefix: str, num_documents: int, split: str, upstream: str) -> list[str]:
    """The document ranges of one corpus as both upstreams log them, the one used here first."""
    bounds = _megatron_deepspeed_bounds(num_documents, split)
    logs = {
        MEGATRON_DEEPSPEED: [
            f"    {name}:\n     document indices in [{lo}, {hi}) total of {hi - lo} documents"
            for name, lo, hi in zip(SPLIT_NAMES, bounds[:-1], bounds[1:])
        ],
        MEGATRON_LM: [
            f"    Let split_matrix = {_split_matrix(split)}",
            "    documents: "
            + ", ".join(
                f"{name} {'none' if r is None else f'[{r[0]}, {r[1]})'}"
                for name, r in zip(SPLIT_NAMES, split_ranges(num_documents, split, MEGATRON_LM))
            ),
        ],
    }
    titles = {MEGATRON_DEEPSPEED: "Megatron-DeepSpeed's split", MEGATRON_LM: "megatron-core's split (Megatron-LM)"}
    other = MEGATRON_LM if upstream == MEGATRON_DEEPSPEED else MEGATRON_DEEPSPEED
    agree = _mds_or_none(bounds) == _effective(split_ranges(num_documents, split, MEGATRON_LM))
    return [
        f"> data {prefix}: {num_documents} documents, --split {split}",
        f" > {titles[upstream]}, used here (--data-upstream {upstream}):",
        *logs[upstream],
        f" > {titles[other]} would give {'the same' if agree else 'other'} documents (--data-upstream {other}):",
        *logs[other],
    ]


def _mds_or_none(bounds: Sequence[int]) -> list[Range | None]:
    return [(lo, hi) if hi > lo else None for lo, hi in zip(bounds[:-1], bounds[1:])]
