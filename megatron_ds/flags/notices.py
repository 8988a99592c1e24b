"""The two lines the command line's translation prints once before training starts, on rank 0 only (`RANK` unset: a
single process): NOTICE, a flag accepted with a meaning that differs from upstream's or one that changes nothing here
(stdout, as every other NOTICE the trainer prints and Megatron-DeepSpeed's `print_rank_0`); WARNING, an option that is
ignored (stderr).

One printer of each for every flags module (a leaf: it imports nothing of the package, so any of them can call it).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

_muted: list[bool] = []


def notice(text: str) -> None:
    """Print `NOTICE: text` on rank 0 (not inside `muted`)."""
    if os.environ.get("RANK", "0") == "0" and not _muted:
        print(f"NOTICE: {text}", file=sys.stdout, flush=True)


def warn(message: str) -> None:
    """A one-line warning for an ignored option, printed once (by rank 0) before training starts."""
    if os.environ.get("RANK", "0") == "0":
        print(f"WARNING: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def muted() -> Iterator[None]:
    """No NOTICE inside (warnings still print): a tool translating a model it read into flags of its own, whose
    notices speak of a launch that is not the user's (`interop.hf_import.config_from_hf`)."""
    _muted.append(True)
    try:
        yield
    finally:
        _muted.pop()
