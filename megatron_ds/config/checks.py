"""The checks the config dataclasses run in `__post_init__`: each raises a one-line `ConfigError`.

Messages name the command-line flag that sets the field (`--lr nan is not a finite number; ...`),
so the CLI, the Python API and the planner report a bad value the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from megatron_ds.errors import ConfigError


def check(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless `ok`."""
    if not ok:
        raise ConfigError(message)


def at_least(flag: str, value: float, minimum: float, why: str = "") -> None:
    """`value` is a finite number >= `minimum`; `why` is appended to the range message."""
    check(math.isfinite(value), f"{flag} {value} is not a finite number; give a value >= {minimum}")
    check(value >= minimum, f"{flag} {value} must be >= {minimum}{why}")


def optional_at_least(flag: str, value: float | None, minimum: float) -> None:
    """`at_least` for a field whose None means "not given"."""
    if value is not None:
        at_least(flag, value, minimum)


def positive(flag: str, value: float) -> None:
    """A finite number > 0."""
    check(math.isfinite(value), f"{flag} {value} is not a finite number; give a value > 0")
    check(value > 0, f"{flag} {value} must be > 0")


def probability(flag: str, value: float) -> None:
    """A finite number in [0, 1): dropout probabilities, Adam betas."""
    check(math.isfinite(value) and 0.0 <= value < 1.0, f"{flag} {value} must be in [0, 1)")


def one_of(flag: str, value: object, choices: Iterable[object]) -> None:
    choices = tuple(choices)
    check(value in choices, f"{flag} {value!r} is not one of {', '.join(map(str, choices))}; choose one of them")
