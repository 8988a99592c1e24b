"""Flags -> the profiler fields of the logging section. `--profile` is two profilers: bare, Megatron-LM's (steps
`--profile-step-start`+1 .. `--profile-step-end`); with `pt` or `pt-full`, Megatron-DeepSpeed's (steps
`--profile_steps S,E` of this process). The range flags of the profiler not chosen are ignored with a warning."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from megatron_ds.config import PROFILER_MODES, LoggingConfig
from megatron_ds.errors import ConfigError
from megatron_ds.flags.declare import flag_of

_MEGATRON_LM_RANGE = ("profile_step_start", "profile_step_end", "use_pytorch_profiler")


def profile_steps(text: str) -> tuple[int, int]:
    """`--profile_steps S,E` as Megatron-DeepSpeed reads it (`map(int, text.split(','))`)."""
    try:
        start, end = (int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--profile_steps {text!r} is not two step numbers; give the first and last step as S,E, e.g. 2,3"
        ) from None
    return start, end


def profiler_fields(args: argparse.Namespace) -> dict[str, Any]:
    """`profile`, `profile_pt`, `profile_steps` and `profile_ranks` of `LoggingConfig`."""
    return {
        "profile": args.profile is True,
        "profile_pt": args.profile if args.profile in PROFILER_MODES else None,
        "profile_steps": profile_steps(args.profile_steps),
        "profile_ranks": tuple(args.profile_ranks or ()),
    }


def warn_ignored(args: argparse.Namespace, logging: LoggingConfig, warn: Callable[[str], None]) -> None:
    """The range flags of the profiler not chosen (checked by `logging` first)."""
    defaults = LoggingConfig()
    if logging.profile_pt is None and logging.profile_steps != defaults.profile_steps:
        # Megatron-DeepSpeed reads it only under --profile pt|pt-full: accepted, but said to do nothing
        warn(f"--profile_steps {args.profile_steps} applies to --profile pt or pt-full; ignored without them")
    given = [d for d in _MEGATRON_LM_RANGE if getattr(args, d) != getattr(defaults, d)]
    if logging.profile_pt is not None and given:
        start, end = logging.profile_steps
        warn(
            f"{', '.join(map(flag_of, given))} {'apply' if len(given) > 1 else 'applies'} to Megatron-LM's bare "
            f"--profile; --profile {logging.profile_pt} traces --profile_steps {start},{end}; ignored"
        )
