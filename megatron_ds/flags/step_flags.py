"""Flags -> what changes from step to step: the batch-size schedule (`--rampup-batch-size`,
`--step-batch-size-schedule`), the `curriculum_learning` section of `--deepspeed_config`, the
weight-decay schedule's length. The schedules themselves are `megatron_ds.config.schedules`."""

from __future__ import annotations

import argparse
import math

from megatron_ds.config.schedules import CURRICULUM_KEY, CurriculumConfig
from megatron_ds.errors import ConfigError

_SUFFIXES = {"T": 1_000_000_000_000, "B": 1_000_000_000, "M": 1_000_000, "K": 1_000}


def _number(text: str, entry: str) -> int:
    """Megatron-LM's `_parse_numeric_value`: a number with an optional K/M/B/T suffix, as an int."""
    value = text.strip().upper()
    multiplier = _SUFFIXES.get(value[-1:], 1)
    if multiplier != 1:
        value = value[:-1]
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise ConfigError(
            f"--step-batch-size-schedule entry {entry!r}: {text!r} is not a number (K, M, B, T suffixes allowed)"
        ) from None
    return int(number * multiplier)  # Megatron-LM's own rounding: int(float(v) * multiplier)


def step_schedule(words: str | list[str] | None, seq_length: int) -> tuple[tuple[int, int], ...] | None:
    """`--step-batch-size-schedule 'THRESHOLD:BATCH ...'` (one word, or several) as (threshold in
    samples, batch) pairs: Megatron-LM reads thresholds as tokens (it always passes --seq-length) and
    floors them to samples."""
    if words is None:
        return None
    text = words if isinstance(words, str) else " ".join(words)
    pairs = []
    for entry in text.strip().replace(",", " ").split():
        if ":" not in entry:
            raise ConfigError(f"--step-batch-size-schedule entry {entry!r}: expected THRESHOLD:BATCH_SIZE")
        threshold, batch = entry.split(":", 1)
        pairs.append((_number(threshold, entry) // seq_length, _number(batch, entry)))
    if not pairs:
        raise ConfigError("--step-batch-size-schedule is empty; give THRESHOLD:BATCH_SIZE pairs, the first at 0")
    return tuple(sorted(pairs, key=lambda p: p[0]))


def global_batch_size(args: argparse.Namespace, schedule: tuple[tuple[int, int], ...] | None, default: int) -> int:
    """--global-batch-size, or the schedule's last batch size (Megatron-LM's global batch size then)."""
    if args.global_batch_size is not None:
        return args.global_batch_size
    return schedule[-1][1] if schedule else default


def rampup(args: argparse.Namespace) -> tuple[int, int, int] | None:
    return None if args.rampup_batch_size is None else tuple(args.rampup_batch_size)  # type: ignore[return-value]


def curriculum(path: str | None) -> CurriculumConfig | None:
    """The legacy curriculum the `--deepspeed_config` file asks for (read before any process starts)."""
    if not path:
        return None
    from megatron_ds.training.deepspeed_config import load_user_config

    return CurriculumConfig.from_json(load_user_config(path).get(CURRICULUM_KEY), f"--deepspeed_config {path}")


def weight_decay_incr_samples(args: argparse.Namespace, gbs: int, budget: int) -> int:
    """The samples a linear or cosine weight-decay schedule spans, as Megatron counts them:
    --train-samples, else --train-iters x the global batch size."""
    return args.train_samples if args.train_samples is not None else budget * gbs
