"""Byte sizes as people read them: the one formatter every table and message uses. Pure."""

from __future__ import annotations

import math

MIB = 1024**2
GIB = 1024**3


def format_bytes(num_bytes: float, digits: int = 3) -> str:
    """Binary units: `512 B`, `1.50 KiB`, `12.30 GiB`, `456 MiB`, `digits - 3` more decimals when asked;
    infinity (no limit) is `unlimited`."""
    if math.isinf(num_bytes):
        return "unlimited"
    value, unit = float(num_bytes), "B"
    rounds_up = 1024 - 0.5 * 10 ** -max(0, digits - 3)  # a value that prints as 1024 reads as the next unit
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < rounds_up or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{value:.0f} B"
    extra = digits - 3  # decimals beyond the default's
    if abs(value) >= 100:
        return f"{value:.{max(0, extra)}f} {unit}"  # not .3g: 1000-1023 would read 1e+03
    return f"{value:.{2 + extra}f} {unit}"


def format_apart(a: float, b: float) -> tuple[str, str]:
    """`format_bytes` of two different sizes with enough figures that they read differently (a need just over
    a limit: `127.4 GiB`, `127.0 GiB`, not `127 GiB` twice)."""
    for digits in range(3, 7):
        pair = format_bytes(a, digits), format_bytes(b, digits)
        if pair[0] != pair[1] or a == b:
            return pair
    return pair


def format_seconds(seconds: float, digits: int = 3) -> str:
    """`digits` significant figures, trailing zeros kept so columns compare, no exponents: `0.0104 s`,
    `6.00 s`, `1,870 s`, `18.6 us`."""
    if seconds >= 10**digits:
        return f"{seconds:,.0f} s"
    if 0 < seconds < 1e-4:
        return f"{seconds * 1e6:#.{digits}g}".rstrip(".") + " us"
    if seconds == 0:
        return "0 s"
    return f"{seconds:#.{digits}g}".rstrip(".") + " s"


def format_number(value: float, digits: int = 4) -> str:
    """A table cell: `digits` significant figures, thousands separated, never an exponent (`11,090`,
    `106.8`, `0.0123`, `<0.0001`)."""
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    if value == 0 or abs(value) >= 1e-4:
        return f"{value:.{digits}g}"
    return "<0.0001" if value > 0 else "-<0.0001"
