"""Checks of every input file and directory, run before any process group exists.

Each failure is a one-line `ValueError` subclass naming the flag or file and the fix, so a typo
in a path costs seconds, not a cluster start-up (and never a hang).
"""

from __future__ import annotations

from megatron_ds.config import Config
from megatron_ds.errors import ConfigError
from megatron_ds.training import deepspeed_config, zero_checks
from megatron_ds.training.checkpoint import save_load


def check_data(config: Config) -> None:
    """Data prefixes exist and are sound, splits are usable, a tokenizer is given for real data."""
    from megatron_ds.data.gpt_data import check_splits, parse_data_path, parse_split
    from megatron_ds.data.indexed import read_index

    data = config.data
    if data.mock_data:
        return
    if not data.data_path:
        raise ConfigError("no training data: give --data-path PREFIX (see tools/preprocess_data.py) or --mock-data")
    if data.tokenizer_type is None:
        raise ConfigError("--data-path needs --tokenizer-type (and --tokenizer-model or --vocab-file/--merge-file)")
    prefixes, _ = parse_data_path(data.data_path)
    parse_split(data.split)
    check_splits([read_index(p) for p in prefixes], data.split)


def check_logging(config: Config) -> None:
    from megatron_ds.training.logger import tensorboard_available

    if config.logging.tensorboard_dir and not tensorboard_available():
        raise ConfigError(
            f"--tensorboard-dir {config.logging.tensorboard_dir}: tensorboard is not installed; "
            f"pip install tensorboard (or pip install -e '.[tensorboard]'), or drop the flag"
        )


def check_launch(config: Config) -> None:
    """All file-system checks, in the order a user would fix them (the `--deepspeed_config` file
    included: a contradiction with the flags is reported before any process group exists)."""
    check_data(config)
    save_load.check_dirs(config)
    check_logging(config)
    deepspeed_config.build(config)
    zero_checks.check_offload_runs_here(config)  # offload's ops build here, its host memory is there
