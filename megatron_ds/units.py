"""Byte sizes as people read them: the one formatter every table and message uses. Pure."""

from __future__ import annotations

import math

MIB = 1024**2
GIB = 1024**3


def format_bytes(num_bytes: float) -> str:
    """Binary units, three significant figures: `512 B`, `1.50 KiB`, `12.3 GiB`, `456 MiB`;
    infinity (no limit) is `unlimited`."""
    if math.isinf(num_bytes):
        return "unlimited"
    value, unit = float(num_bytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{value:.0f} B"
    return f"{value:.3g} {unit}" if abs(value) >= 100 else f"{value:.2f} {unit}"
