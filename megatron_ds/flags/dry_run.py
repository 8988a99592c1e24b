"""`--print-layout` as a dry run on any machine: what it warns about instead of refusing, and what
it stands in for that a launch requires. The checks of the files themselves are the launch's own
(`training.launch_checks.check_launch(config, dry_run=True)`)."""

from __future__ import annotations

import argparse

from megatron_ds.config import Config
from megatron_ds.errors import ConfigError
from megatron_ds.estimate import machine as machines


def runs_on_warning(config: Config, machine: machines.Machine, dry_run: bool) -> str | None:
    """What this machine cannot run is an error, except under `--print-layout` (a login node previews a
    GPU run): then the warning to print, saying what a launch here would refuse."""
    try:
        machines.check_runs_on(config, machine)
    except ConfigError as err:
        if not dry_run:
            raise
        return f"a launch on this machine would stop here: {err} (--print-layout previews it anyway)"
    return None


def launch_gaps(args: argparse.Namespace) -> list[str]:
    """What `--print-layout` stands in for that a launch requires (it says so after the layout)."""
    gaps = ["--lr"] if args.lr is None else []
    if args.vocab_size is None and args.tokenizer_type is None and not (args.vocab_file or args.merge_file):
        gaps.append("--vocab-size or a tokenizer")
    if args.train_iters is None and args.train_samples is None and args.train_tokens is None:
        gaps.append("--train-iters (or --train-samples, --train-tokens)")
    files = args.data_args_path or args.per_split_data_args_path
    if not (args.data_path or args.train_data_path or files) and not args.mock_data:
        gaps.append("--data-path or --mock-data")
    return gaps
