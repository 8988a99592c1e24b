#!/usr/bin/env python
"""Pretrain a GPT on DeepSpeed's pipeline engine (Megatron-compatible flags).

    python pretrain_gpt.py --num-layers 3 --hidden-size 64 --num-attention-heads 4 \
        --seq-length 32 --pipeline-model-parallel-size 5 --pp-dedicated-embedding-stages --print-layout

Launch training with `deepspeed` or `torchrun` (see examples/). User errors print one line
`error: ...` and exit with status 2, before any process group is created. `--print-layout` is a
dry run of the same checks on any machine. Ctrl-C and SIGTERM stop every rank at once with one
line each; with `--exit-signal-handler` SIGTERM saves first (`megatron_ds.training.signals`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NoReturn


def is_user_error(exc: BaseException) -> bool:
    """Errors our code raises for bad input (`megatron_ds.errors.UserError` and its subclasses)."""
    from megatron_ds.errors import UserError

    return isinstance(exc, UserError)


def _report(exc: BaseException) -> None:
    """Before the process group exists every rank fails alike: rank 0 speaks for all. After, each
    failing rank speaks for itself."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        prefix = f"[rank {dist.get_rank()}] " if dist.get_world_size() > 1 else ""
        sys.stderr.write(f"{prefix}error: {exc}\n")  # one write: ranks sharing a pipe do not split each other's lines
        sys.stderr.flush()
    elif os.environ.get("RANK", "0") == "0":
        print(f"error: {exc}", file=sys.stderr, flush=True)


def _print_notices(notices: list[str]) -> None:
    import os

    if os.environ.get("RANK", "0") == "0":
        for line in notices:
            print(line, flush=True)


def _print_gaps(args: object) -> None:
    from megatron_ds.flags.dry_run import launch_gaps
    from megatron_ds.flags.notices import warn

    gaps = launch_gaps(args)
    if gaps:
        warn(f"to launch, this line also needs {'; '.join(gaps)}")


def main(argv: Sequence[str] | None = None) -> int:
    from megatron_ds.training import signals

    exit_signals = signals.install()  # first: Ctrl-C or SIGTERM at any point is one line per rank
    import os

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # say so, instead of DeepSpeed warning on every rank
    from megatron_ds.distributed import shutdown_distributed
    from megatron_ds.flags.parser import parse_config
    from megatron_ds.training.machine import probe

    clean = False
    try:
        config, args = parse_config(argv, machine=probe())  # the layout is checked here, not measured
        exit_signals.save_on_sigterm = config.training.exit_signal_handler
        from megatron_ds.training.launch_checks import check_launch

        _print_notices(check_launch(config, dry_run=args.print_layout))  # --print-layout: the same checks
        if args.print_layout:
            from megatron_ds.training.resolve_layout import layout_text, resolve_layout

            print(layout_text(config, resolve_layout(config)))
            _print_gaps(args)
            return 0
        from megatron_ds.training.loop import pretrain

        pretrain(config)  # the builder resolves the layout, once
        clean = True
    except Exception as exc:  # noqa: BLE001 - user errors become one line, the rest propagate
        if not is_user_error(exc):
            raise
        _report(exc)
        return 2
    finally:
        # Every exit path (success, user error, crash) joins gloo's threads before the interpreter
        # finalises; see megatron_ds.distributed for the abort this prevents.
        shutdown_distributed(clean=clean)
        signals.uninstall()
    return 0


def run_script(argv: Sequence[str] | None = None) -> NoReturn:
    """`python pretrain_gpt.py ...`: `main`'s status, left through `megatron_ds.distributed.run_and_exit`: after
    process groups the interpreter must not finalise (a gloo worker thread still alive then aborts the rank)."""
    from megatron_ds.distributed import run_and_exit

    run_and_exit(main, argv)


if __name__ == "__main__":
    run_script()
