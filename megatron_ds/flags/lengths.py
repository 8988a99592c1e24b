"""Training and learning-rate schedule lengths in Megatron's units (iterations, samples, tokens).

`train_length` is how many iterations to run (and the budget the lr decay defaults to);
`schedule_lengths` gives `OptimizerConfig`'s warm-up and decay fields under Megatron's rules
(iteration-based training takes iteration lr flags, sample-based sample ones, tokens go with either).
"""

from __future__ import annotations

import argparse
import math

from megatron_ds.errors import ConfigError
from megatron_ds.flags.declare import flag_of


def train_length(args: argparse.Namespace, gbs: int, seq_length: int) -> tuple[int, int]:
    """(train_iters, budget): the iterations to run, and those of --train-iters/--train-samples alone
    (what the lr decay defaults to; --train-tokens may stop training earlier)."""
    if args.train_iters is not None and args.train_samples is not None:
        raise ConfigError("--train-iters and --train-samples were both given; keep one")
    for dest in ("train_iters", "train_samples", "train_tokens"):
        if getattr(args, dest) is not None and getattr(args, dest) < 1:
            raise ConfigError(f"{flag_of(dest)} {getattr(args, dest)} must be >= 1")
    by_tokens = math.ceil(args.train_tokens / (gbs * seq_length)) if args.train_tokens is not None else None
    if args.train_samples is not None:
        budget = math.ceil(args.train_samples / gbs)
    elif args.train_iters is not None:
        budget = args.train_iters
    elif by_tokens is not None:
        budget = by_tokens
    elif args.print_layout:
        return 0, 0
    else:
        raise ConfigError("missing --train-iters (or --train-samples or --train-tokens); say how long to train")
    return min(budget, by_tokens or budget), budget


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


def schedule_lengths(args: argparse.Namespace, gbs: int, seq_length: int) -> dict[str, int | None]:
    """The OptimizerConfig warm-up and decay fields: the decay in one unit (tokens if given, else the
    unit of training), the warm-up as given or as --lr-warmup-fraction of the decay."""
    _check_schedule_units(args)
    budget = train_length(args, gbs, seq_length)[1]
    if args.lr_decay_tokens is not None:
        decay = {"lr_decay_tokens": args.lr_decay_tokens}
    elif args.lr_decay_samples is not None or args.train_samples is not None:
        decay = {"lr_decay_samples": args.lr_decay_samples or args.train_samples}
    elif args.lr_decay_iters is not None or args.train_iters is not None or args.train_tokens is None:
        decay = {"lr_decay_iters": args.lr_decay_iters or budget}
    else:  # --train-tokens alone: decay over exactly those tokens
        decay = {"lr_decay_tokens": args.train_tokens}
    fraction = args.lr_warmup_fraction
    if fraction is None:
        warmup = {
            "lr_warmup_iters": args.lr_warmup_iters,
            "lr_warmup_samples": args.lr_warmup_samples,
            "lr_warmup_tokens": args.lr_warmup_tokens,
        }
    elif not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"--lr-warmup-fraction {fraction} must be in [0, 1]")
    else:
        ((key, length),) = decay.items()
        warmup = {key.replace("decay", "warmup"): int(fraction * length)}
    return {**decay, **warmup}
