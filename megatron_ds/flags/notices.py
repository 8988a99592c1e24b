"""The two lines the command line's translation prints once before training starts, on rank 0 only (`RANK` unset: a
single process): NOTICE, a flag accepted with a meaning that differs from upstream's or one that changes nothing here
(stdout, as every other NOTICE the trainer prints and Megatron-DeepSpeed's `print_rank_0`); WARNING, an option that is
ignored (stderr).

One printer of each for every flags module (a leaf: it imports nothing of the package, so any of them can call it).
"""

from __future__ import annotations

import os
import sys


def notice(text: str) -> None:
    """Print `NOTICE: text` on rank 0."""
    if os.environ.get("RANK", "0") == "0":
        print(f"NOTICE: {text}", file=sys.stdout, flush=True)


def warn(message: str) -> None:
    """A one-line warning for an ignored option, printed once (by rank 0) before training starts."""
    if os.environ.get("RANK", "0") == "0":
        print(f"WARNING: {message}", file=sys.stderr, flush=True)
