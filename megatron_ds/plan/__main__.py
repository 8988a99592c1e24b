"""Entry point of `python -m megatron_ds.plan` and the `megatron-ds-plan` console script."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the planner; returns the exit status (0 ok, 1 a check failed, 2 bad input)."""
    from megatron_ds.plan.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
