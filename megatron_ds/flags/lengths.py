"""Training and learning-rate schedule lengths in Megatron's units (iterations, samples, tokens).

`train_length` is how many iterations to run (and the budget the lr decay defaults to);
`schedule_lengths` gives `OptimizerConfig`'s warm-up and decay fields under Megatron's rules
(iteration-based training takes iteration lr flags, sample-based sample ones, tokens go with either).
"""

from __future__ import annotations

import argparse
import math
from typing import Protocol

from megatron_ds.errors import ConfigError
from megatron_ds.flags.declare import flag_of


class StepSizes(Protocol):
    """What a step consumes (`TrainingConfig`): its global batch size and tokens per sample."""

    def batch_size_at(self, consumed_samples: int) -> int: ...

    def seq_length_at(self, step: int, seq_length: int) -> int: ...

    def sizes_settle_at(self, seq_length: int) -> tuple[int, int]: ...


def steps_to_reach(sizes: StepSizes, seq_length: int, samples: int | None, tokens: int | None) -> int:
    """The first step count whose consumed samples reach `samples` or whose tokens reach `tokens`
    (whichever comes first), stepping through a batch-size schedule and a curriculum; the constant
    part after both settle is counted in closed form."""
    settle_samples, settle_step = sizes.sizes_settle_at(seq_length)
    step, consumed, consumed_tokens = 0, 0, 0
    while True:
        if (samples is not None and consumed >= samples) or (tokens is not None and consumed_tokens >= tokens):
            return step
        if consumed >= settle_samples and step >= settle_step:
            break
        batch = sizes.batch_size_at(consumed)
        consumed, consumed_tokens = (
            consumed + batch,
            consumed_tokens + batch * sizes.seq_length_at(step + 1, seq_length),
        )
        step += 1
    batch, length = sizes.batch_size_at(consumed), sizes.seq_length_at(step + 1, seq_length)
    more = [math.ceil((samples - consumed) / batch)] if samples is not None else []
    more += [math.ceil((tokens - consumed_tokens) / (batch * length))] if tokens is not None else []
    return step + min(more)


def rampup_steps(sizes: StepSizes, ramp_samples: int, samples: int, gbs: int) -> int:
    """--train-samples' iterations under --rampup-batch-size as Megatron-DeepSpeed's `update_train_iters` counts them:
    the ramp-up's steps while the consumed samples are at most its length, then `(samples - consumed) // gbs` (a last
    partial batch is not run)."""
    step, consumed = 0, 0
    while consumed <= ramp_samples:
        consumed, step = consumed + sizes.batch_size_at(consumed), step + 1
    return step + (samples - consumed) // gbs


def samples_after(sizes: StepSizes, seq_length: int, steps: int) -> int:
    """The samples `steps` steps consume under a batch-size schedule."""
    settle_samples, settle_step = sizes.sizes_settle_at(seq_length)
    step, consumed = 0, 0
    while step < steps and (consumed < settle_samples or step < settle_step):
        consumed, step = consumed + sizes.batch_size_at(consumed), step + 1
    return consumed + (steps - step) * sizes.batch_size_at(consumed)


def rampup_decay_notice(args: argparse.Namespace, gbs: int, seq_length: int, sizes: StepSizes) -> str | None:
    """--rampup-batch-size with --train-iters: the iterations consume fewer samples than the decay they default to
    spans (--train-iters x the global batch size), so training ends before the decay. Megatron-DeepSpeed refuses the
    pair; Megatron-LM runs it as here."""
    if args.rampup_batch_size is None or args.train_iters is None or args.lr_decay_tokens is not None:
        return None
    consumed = samples_after(sizes, seq_length, args.train_iters)
    decay = (args.lr_decay_iters or args.train_iters) * gbs
    if consumed >= decay:
        return None
    return (
        f"--rampup-batch-size with --train-iters {args.train_iters}: the ramp-up's smaller batches make them consume "
        f"{consumed} samples, but the learning-rate decay spans {decay} (--lr-decay-iters, by default --train-iters, x "
        f"--global-batch-size {gbs}), so training ends before the decay does; Megatron-DeepSpeed refuses this pair, "
        f"Megatron-LM runs it as here; give --train-samples (and --lr-decay-samples) for a decay that ends with training"
    )


def _too_short(samples: int, gbs: int) -> ConfigError:
    return ConfigError(
        f"--train-samples {samples} is less than one global batch of {gbs} samples: Megatron runs only whole "
        f"batches (train_samples // global batch size iterations); give at least {gbs}"
    )


def train_length(
    args: argparse.Namespace, gbs: int, seq_length: int, sizes: StepSizes | None = None
) -> tuple[int, int]:
    """(train_iters, budget): the iterations to run, and those of --train-iters/--train-samples alone
    (what the lr decay defaults to; --train-tokens may stop training earlier). --train-samples runs its whole
    global batches, as Megatron (`update_train_iters`: train_samples // global batch size; the dataset is still
    asked for all of them). With `sizes` (a batch-size schedule or a curriculum), samples and tokens are counted
    step by step."""
    if args.train_iters is not None and args.train_samples is not None:
        raise ConfigError("--train-iters and --train-samples were both given; keep one")
    for dest in ("train_iters", "train_samples", "train_tokens"):
        if getattr(args, dest) is not None and getattr(args, dest) < 1:
            raise ConfigError(f"{flag_of(dest)} {getattr(args, dest)} must be >= 1")
    if sizes is not None:
        return _scheduled_length(args, gbs, seq_length, sizes)
    by_tokens = math.ceil(args.train_tokens / (gbs * seq_length)) if args.train_tokens is not None else None
    if args.train_samples is not None:
        budget = args.train_samples // gbs
        if budget == 0:
            raise _too_short(args.train_samples, gbs)
    elif args.train_iters is not None:
        budget = args.train_iters
    elif by_tokens is not None:
        budget = by_tokens
    elif args.print_layout:
        return 0, 0
    else:
        raise ConfigError("missing --train-iters (or --train-samples or --train-tokens); say how long to train")
    return min(budget, by_tokens or budget), budget


def _scheduled_length(args: argparse.Namespace, gbs: int, seq_length: int, sizes: StepSizes) -> tuple[int, int]:
    """`train_length` when the batch size or the sequence length changes from step to step."""
    if args.train_samples is not None and args.step_batch_size_schedule is not None:
        budget = steps_to_reach(sizes, seq_length, args.train_samples, None)  # Megatron-LM's loop: a partial last step
    elif args.train_samples is not None:
        ramp = args.rampup_batch_size
        budget = args.train_samples // gbs if ramp is None else rampup_steps(sizes, ramp[2], args.train_samples, gbs)
        if budget < 1:
            raise _too_short(args.train_samples, gbs)
    elif args.train_iters is not None:
        budget = args.train_iters
    elif args.train_tokens is not None:
        budget = steps_to_reach(sizes, seq_length, None, args.train_tokens)
    elif args.print_layout:
        return 0, 0
    else:
        raise ConfigError("missing --train-iters (or --train-samples or --train-tokens); say how long to train")
    if args.train_tokens is None:
        return budget, budget
    return min(budget, steps_to_reach(sizes, seq_length, None, args.train_tokens)), budget


def _check_schedule_units(args: argparse.Namespace) -> None:
    """Megatron's rules: iteration-based training takes iteration lr flags, sample-based sample ones;
    token flags go with either; one warm-up flag at most."""
    wrong = []
    if args.train_iters is not None:
        wrong = [d for d in ("lr_decay_samples", "lr_warmup_samples") if getattr(args, d)]
    elif args.train_samples is not None:
        wrong = [d for d in ("lr_decay_iters", "lr_warmup_iters") if getattr(args, d)]
    if wrong:
        based = "--train-iters" if args.train_iters is not None else "--train-samples"
        raise ConfigError(
            f"{flag_of(wrong[0])} does not go with {based}: give the lr schedule in the unit of "
            f"training ({'iterations' if args.train_iters is not None else 'samples'}) or in tokens"
        )
    warmups = [d for d in ("lr_warmup_iters", "lr_warmup_samples") if getattr(args, d)]
    warmups += [d for d in ("lr_warmup_tokens", "lr_warmup_fraction") if getattr(args, d) is not None]
    if len(warmups) > 1:
        raise ConfigError(f"{' and '.join(map(flag_of, warmups))} were both given; keep one")


def schedule_lengths(
    args: argparse.Namespace, gbs: int, seq_length: int, sizes: StepSizes | None = None
) -> dict[str, int | None]:
    """The OptimizerConfig warm-up and decay fields: the decay in one unit (tokens if given, else the
    unit of training), the warm-up as given (--lr-warmup-fraction: of the decay)."""
    _check_schedule_units(args)
    budget = train_length(args, gbs, seq_length, sizes)[1]
    if args.lr_decay_tokens is not None:
        decay = {"lr_decay_tokens": args.lr_decay_tokens}
    elif args.lr_decay_samples is not None or args.train_samples is not None:
        decay = {"lr_decay_samples": args.lr_decay_samples or args.train_samples}
    elif args.lr_decay_iters is not None or args.train_iters is not None or args.train_tokens is None:
        decay = {"lr_decay_iters": args.lr_decay_iters or budget}
    else:  # --train-tokens alone: decay over exactly those tokens
        decay = {"lr_decay_tokens": args.train_tokens}
    warmup = {
        "lr_warmup_iters": args.lr_warmup_iters,
        "lr_warmup_samples": args.lr_warmup_samples,
        "lr_warmup_tokens": args.lr_warmup_tokens,
        "lr_warmup_fraction": args.lr_warmup_fraction,  # of the decay, in its unit (OptimizerConfig.schedule_lengths)
    }
    return {**decay, **warmup}
