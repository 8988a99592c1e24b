"""`--data-upstream auto`: which upstream a command line comes from, for the data's split and blend rules.

Megatron-DeepSpeed and Megatron-LM (megatron-core) split the documents and size a blend's parts
differently (`megatron_ds.data.splits`), so the same `--split` trains on other documents. A line
is taken as Megatron-LM's when it sets one of the flags only Megatron-LM has (below) to a value
other than its default; anything else is Megatron-DeepSpeed's, the launch lines this project
replaces. `--data-upstream megatron-deepspeed|megatron-lm` says it explicitly.
"""

from __future__ import annotations

import argparse
import os
import sys

import megatron_ds.flags.megatron_lm as megatron_lm
from megatron_ds.config import DATA_UPSTREAMS, PROFILER_MODES
from megatron_ds.flags.declare import ACCEPTED
from megatron_ds.flags.registry import BY_NAME

AUTO = "auto"
MEGATRON_DEEPSPEED, MEGATRON_LM = DATA_UPSTREAMS
MEGATRON_LM_FLAGS = (
    "--rotary-base",
    "--pipeline-model-parallel-layout",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
    "--num-virtual-stages-per-pipeline-rank",
    *(f.name for group in megatron_lm.GROUPS for f in group if f.status == ACCEPTED and f.fields),
)
"""Flags accepted here that Megatron-LM's arguments.py has and Megatron-DeepSpeed's does not: the
layout flags, and each one of `flags/megatron_lm.py` and `flags/megatron_lm_io.py` (its example lines' flags) that sets a config
field (those that change nothing here are left out: they change nothing, the data's rules included)."""


MEGATRON_DEEPSPEED_VALUES = {"--profile": PROFILER_MODES}
"""Values of a flag above that are Megatron-DeepSpeed's: its `--profile pt|pt-full` (Megatron-LM's takes none)."""


def megatron_lm_flags(args: argparse.Namespace) -> list[str]:
    """The Megatron-LM-only flags this line sets to a value other than their default."""
    return [
        n
        for n in MEGATRON_LM_FLAGS
        if (value := getattr(args, BY_NAME[n].attr)) != BY_NAME[n].resolved_default()
        and value not in MEGATRON_DEEPSPEED_VALUES.get(n, ())
    ]


def data_upstream(args: argparse.Namespace) -> str:
    """`--data-upstream`, with `auto` resolved; prints one NOTICE (rank 0) when a Megatron-LM flag
    decides it for a line that reads data files."""
    if args.data_upstream != AUTO:
        return args.data_upstream
    found = megatron_lm_flags(args)
    if not found:
        return MEGATRON_DEEPSPEED
    reads_files = args.data_path or args.train_data_path or args.valid_data_path or args.test_data_path
    reads_files = reads_files or args.data_args_path or args.per_split_data_args_path
    if reads_files and os.environ.get("RANK", "0") == "0":
        print(
            f"NOTICE: {found[0]} is a Megatron-LM flag, so the documents are split and blended by megatron-core's "
            f"rules (--data-upstream {MEGATRON_LM}); give --data-upstream {MEGATRON_DEEPSPEED} for Megatron-DeepSpeed's",
            file=sys.stderr,
            flush=True,
        )
    return MEGATRON_LM
