"""Checks of every input file and directory, run before any process group exists.

Each failure is a one-line `ValueError` subclass naming the flag or file and the fix, so a typo
in a path costs seconds, not a cluster start-up (and never a hang).
"""

from __future__ import annotations

import os

from megatron_ds import files
from megatron_ds.config import Config
from megatron_ds.config.data import SPLIT_PATH_FLAGS
from megatron_ds.errors import ConfigError, UserError
from megatron_ds.training import deepspeed_config, determinism, distillation, zero_checks
from megatron_ds.training.checkpoint import save_load
from megatron_ds.training.dependencies import check_deepspeed


def check_data(config: Config, dry_run: bool = False) -> list[str]:
    """Data prefixes exist and are sound, every split that is read gets tokens, a tokenizer is given
    for real data; finetune_llama.py's examples are read and tokenized (`check_prompt_data`). Returns the
    lines to print."""
    from megatron_ds.data.gpt_data import plan_data
    from megatron_ds.data.splits import check_train_share, requested_samples

    data = config.data
    if data.mock_data or (dry_run and not data.has_data):  # --print-layout says what it lacks
        return []
    if data.prompt_data:
        return check_prompt_data(config)
    if not data.has_data:
        raise ConfigError("no training data: give --data-path PREFIX (see tools/preprocess_data.py) or --mock-data")
    if data.tokenizer_type is None:
        given = [f for f, path in zip(SPLIT_PATH_FLAGS, data.split_paths) if path]
        flag = "--data-path" if data.data_path else given[0]
        raise ConfigError(f"{flag} needs --tokenizer-type (and --tokenizer-model or --vocab-file/--merge-file)")
    if not data.has_split_paths and not config.training.skip_train:
        check_train_share(data.split, config.training.train_iters)
    plan_data(data, requested_samples(config.training))
    return []


def check_prompt_data(config: Config) -> list[str]:
    """finetune_llama.py's JSON: every example tokenized (on every rank alike, before any process group), enough
    samples for the run (or --repeated-dataloader); what it prints."""
    from megatron_ds.config.data import split_fractions
    from megatron_ds.data.batches import samples_per_pass
    from megatron_ds.data.prompt_data import build_prompt_data, check_length, untrained_notice
    from megatron_ds.data.splits import requested_samples

    data, t = config.data, config.training
    if not data.data_path:
        raise ConfigError("no training data: finetune_llama.py needs --data-path EXAMPLES.json (Alpaca's format)")
    prompts = build_prompt_data(data, config.model.seq_length, config.model.vocab_size)
    path, wanted = data.data_path[0], requested_samples(t)[0]
    per_pass = samples_per_pass(len(prompts), t.micro_batch_size, config.parallel.data_parallel_size)
    lines = [check_length(path, len(prompts), per_pass, wanted, t.global_batch_size, data.repeated_dataloader)]
    untrained = prompts.untrained()
    if untrained:
        lines.append(untrained_notice(path, untrained, config.model.seq_length))
    fractions = split_fractions(data.split) or [1.0, 0.0, 0.0]
    if t.eval_iters > 0 and (fractions[1] > 0 or fractions[2] > 0):
        lines.append(
            f"NOTICE: --split {data.split} is not used: finetune_llama.py trains on every example and evaluates "
            "none, as Megatron-DeepSpeed's does"
        )
    return lines


def check_logging(config: Config) -> None:
    from megatron_ds.training.logger import tensorboard_available

    lg = config.logging
    if lg.tensorboard_dir and not tensorboard_available():
        # --profile pt needs the directory: dropping it is no way out there
        drop = f" (--profile {lg.profile_pt} writes its trace there too)" if lg.profile_pt else ", or drop the flag"
        raise ConfigError(
            f"--tensorboard-dir {lg.tensorboard_dir}: tensorboard is not installed; "
            f"pip install tensorboard (or pip install -e '.[tensorboard]'){drop}"
        )
    from megatron_ds.training.scalar_writers import wandb_available

    if lg.wandb_project and not wandb_available():
        raise ConfigError(
            f"--wandb-project {lg.wandb_project}: wandb is not installed; pip install wandb, or drop the "
            "--wandb-* flags"
        )


def check_output_dirs(config: Config, dry_run: bool = False) -> None:
    """--tensorboard-dir and --wandb-save-dir can be written (created unless `dry_run`), as --save is: the logging
    rank creates them only after the process group exists, where a typo was an OSError traceback."""
    lg = config.logging
    for flag, path in (("--tensorboard-dir", lg.tensorboard_dir), ("--wandb-save-dir", lg.wandb_save_dir)):
        if path:
            files.check_writable_directory(flag, path, create=not dry_run, error=ConfigError)


def check_launch(config: Config, dry_run: bool = False) -> list[str]:
    """All file-system checks, in the order a user would fix them (the `--deepspeed_config` file
    included: a contradiction with the flags is reported before any process group exists). Returns
    the NOTICE lines to print once (a first launch, JSON sections ignored, flags the JSON overrules).
    `dry_run` (`--print-layout`) runs the same checks and creates nothing."""
    check_deepspeed(config)
    if config.training.deterministic_mode:
        determinism.check_environment(os.environ)
    data_lines = check_data(config, dry_run)
    if config.training.exit_signal_handler and not config.checkpoint.save:
        raise ConfigError("--exit-signal-handler saves a checkpoint on SIGTERM and needs --save DIR; add it")
    notices = save_load.check_dirs(config, dry_run=dry_run)
    notices += distillation.check_teacher(config)  # --kd: the teacher's checkpoint fits the student
    check_logging(config)
    check_output_dirs(config, dry_run)
    try:
        zero_checks.check_offload_runs_here(config)  # offload's ops build here, its host memory is there
    except UserError as err:
        if not dry_run:
            raise
        # what this machine cannot run, previewed anyway (a login node previews a GPU node's run)
        notices.append(f"WARNING: a launch on this machine would stop here: {err} (--print-layout previews it anyway)")
    ds, ds_notices = deepspeed_config.build_with_notices(config)
    from megatron_ds.training import pipe_schedules  # imports DeepSpeed's schedules

    pipe_schedules.check_deepspeed_config(config.parallel.pipeline_schedule, ds)  # the JSON against the schedule
    return data_lines + notices + ds_notices
