"""The NOTICE line of the command line's translation: a flag accepted with a meaning that differs from upstream's,
or one that changes nothing here, said once before training starts.

One printer for every flags module (a leaf: it imports nothing of the package, so any of them can call it). It
writes to stdout, as every other NOTICE the trainer prints (and Megatron-DeepSpeed's `print_rank_0`), on rank 0
only (`RANK` unset: a single process).
"""

from __future__ import annotations

import os
import sys


def notice(text: str) -> None:
    """Print `NOTICE: text` on rank 0."""
    if os.environ.get("RANK", "0") == "0":
        print(f"NOTICE: {text}", file=sys.stdout, flush=True)
