"""Parsed flags -> the config tree: the mapping that only exists on the command line.

Most flags are copied as given into the config field their declaration names
(`megatron_ds.flags`, `Flag.fields`), and the config tree checks every value and combination
itself (`megatron_ds.config`). What stays here is specific to Megatron's flags: refused values,
defaults that depend on other flags (global batch = micro batch x DP), the world size from the
launcher, Megatron's recompute and lr-schedule unit rules, and warnings for flags that are ignored;
the model section's (required sizes, ffn 4h, positions = sequence length, the tokenizer's
vocabulary, the activation) are in `megatron_ds.flags.to_model_config`. Every check runs before any
process group exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from megatron_ds.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RegularizationConfig,
    TrainingConfig,
)
from megatron_ds.errors import ConfigError, LayoutError
from megatron_ds.estimate.machine import Machine, for_layout
from megatron_ds.estimate.run_layout import check_layout
from megatron_ds.flags import (
    checkpointing_flags,
    compat,
    dry_run,
    megatron_lm_moe,
    model_flags,
    profiler_flags,
    schedule_flags,
    step_flags,
)
from megatron_ds.flags.data_args_files import data_paths_from_files
from megatron_ds.flags.data_upstream import data_upstream
from megatron_ds.flags.declare import ACCEPTED, flag_of
from megatron_ds.flags.deepspeed_json import json_default
from megatron_ds.flags.distillation_flags import distillation_config
from megatron_ds.flags.lengths import rampup_decay_notice, schedule_lengths, train_length
from megatron_ds.flags.notices import notice, warn
from megatron_ds.flags.registry import FLAGS
from megatron_ds.flags.to_model_config import build_model_config, tokenizer_type, unpadded_vocab_size

__all__ = ["ConfigError", "build_config"]


def _refuse_values(args: argparse.Namespace) -> None:
    """Refused values of accepted flags (`Flag.refused_values`), before anything else is checked."""
    for f in FLAGS:
        value = getattr(args, f.attr) if f.refused_values else None
        for one in value if isinstance(value, list) else [value]:  # each value of a list flag
            message = compat.refused_value(f, one) if one is not None else None
            if message:
                raise ConfigError(message)


def direct_values(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{section: {field: value}} of every accepted flag copied as given (not `derived`)."""
    out: dict[str, dict[str, Any]] = {}
    for f in FLAGS:
        if f.status == ACCEPTED and f.fields and not f.derived:
            (path,) = f.fields  # a flag copied as given sets exactly one field
            section, name = path.split(".")
            out.setdefault(section, {})[name] = getattr(args, f.attr)
    return out


def _aml_data_path(args: argparse.Namespace, data_path: Any) -> Any:
    """--data-path under --aml-data-download-path: each entry joined to it as Megatron-DeepSpeed joins them
    (`f"{aml}/{path}"`, the weights too, on which it then fails: a weighted blend is refused here)."""
    root = args.aml_data_download_path
    if root is None:
        return data_path
    weights = [p for p in data_path if _is_number(p)]
    if weights:
        raise ConfigError(
            f"--aml-data-download-path {root} with the weighted --data-path {' '.join(data_path)}: Megatron-DeepSpeed "
            f"joins the weights to it too ({root}/{weights[0]}) and fails; give the blend's full prefixes in --data-path "
            f"and drop --aml-data-download-path"
        )
    return tuple(f"{root}/{p}" for p in data_path)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def data_config(args: argparse.Namespace, direct: dict[str, Any]) -> DataConfig:
    """The data section (also what tools/show_samples.py reads from a pretrain_gpt.py line)."""
    kind = tokenizer_type(args)
    null_vocab = args.vocab_size if kind == "NullTokenizer" else None
    direct = {**direct, **data_paths_from_files(args)}  # --data-args-path, --per-split-data-args-path
    if "data_path" in direct:
        direct = {**direct, "data_path": _aml_data_path(args, direct["data_path"])}
    if getattr(args, "reset_attention_mask", False) and getattr(args, "no_create_attention_mask_in_dataloader", False):
        raise ConfigError(
            "--reset-attention-mask with --no-create-attention-mask-in-dataloader: Megatron-LM then builds no mask and "
            "attends causally over the whole sample, ignoring --reset-attention-mask; drop one of them"
        )
    return DataConfig(
        **direct,
        tokenizer_type=kind,
        data_upstream=data_upstream(args),
        null_tokenizer_vocab_size=null_vocab,
        unpadded_vocab_size=unpadded_vocab_size(args) or None,
    )


def model_config_of(args: argparse.Namespace) -> ModelConfig:
    """The model section alone, by `to_model_config`'s rules (the planner sizes its models with these)."""
    _refuse_values(args)
    return build_model_config(args, direct_values(args).get("model", {}))


_OTHER_LAYOUT_FLAGS = (
    "pp_layout",
    "pipeline_model_parallel_layout",
    "pp_partition_method",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
)


def _dedicated_stages(args: argparse.Namespace) -> str:
    """--pp-dedicated-embedding-stages, with Megatron's --standalone-embedding-stage folded in (= pre)."""
    dedicated = args.pp_dedicated_embedding_stages
    if not args.standalone_embedding_stage:
        return dedicated
    others = [d for d in _OTHER_LAYOUT_FLAGS if getattr(args, d) is not None]
    others += [
        d for d in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split") if getattr(args, d)
    ]
    if others:
        raise ConfigError(
            f"--standalone-embedding-stage and {flag_of(others[0])} were both given; choose one way to place the "
            f"stage boundaries (a layout string starting 'E|' puts the embedding on a stage of its own)"
        )
    return {"none": "pre", "post": "both"}.get(dedicated, dedicated)


def _parallel_config(args: argparse.Namespace, direct: dict[str, Any], world_size: int | None) -> ParallelConfig:
    p, t = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    if args.no_pipeline_parallel and p != 1:
        raise ConfigError(
            f"--no-pipeline-parallel needs --pipeline-model-parallel-size 1 (got {p}); drop one of the two"
        )
    default_world = max(p, 1) * max(t, 1) * max(args.ds_sequence_parallel_size, 1)  # one replica (< 1 refused)
    direct = {**direct, **megatron_lm_moe.expert_parallel(args, direct.get("expert_parallel_size"))}
    if any(n > 1 for n in args.num_experts or ()):  # MoE: the fewest replicas that hold one expert-parallel group
        default_world *= max(direct.get("expert_parallel_size", 1), 1)
    schedule, virtual = schedule_flags.pipeline_schedule(args)
    return ParallelConfig(
        **direct,
        world_size=world_size or args.world_size or int(os.environ.get("WORLD_SIZE", default_world)),
        pp_dedicated_embedding_stages=_dedicated_stages(args),
        pipeline_schedule=schedule,
        virtual_stages=virtual,
        sequence_parallel=model_flags.sequence_parallel(args),
    )


def _training_config(
    args: argparse.Namespace, direct: dict[str, Any], parallel: ParallelConfig, model: ModelConfig
) -> TrainingConfig:
    mbs = 1 if args.micro_batch_size is None else args.micro_batch_size
    schedule = step_flags.step_schedule(args.step_batch_size_schedule, model.seq_length)
    gbs = step_flags.global_batch_size(args, schedule, mbs * parallel.data_parallel_size)
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    _warn_loss_scale_ignored(args, precision)
    recompute, chunk, selective = model_flags.recompute(args, warn)
    training = TrainingConfig(
        **direct,
        selective_recompute=selective,
        micro_batch_size=mbs,
        global_batch_size=gbs,
        precision=precision,
        checkpoint_activations=recompute,
        checkpoint_num_layers=chunk,
        **checkpointing_flags.checkpoint_options(args, recompute, selective),
        zero_stage=model_flags.zero_stage(args, absent=lambda: json_default(args, "zero_stage")),
        rampup_batch_size=step_flags.rampup(args),
        step_batch_size_schedule=schedule,
        deepspeed_config=args.deepspeed_config,
        curriculum=step_flags.curriculum(args.deepspeed_config),
    )  # checked before train_length divides by the batch size
    sizes = training if training.varies else None
    iters = train_length(args, gbs, model.seq_length, sizes)[0]
    rampup = rampup_decay_notice(args, gbs, model.seq_length, training)
    if rampup:
        notice(rampup)
    return dataclasses.replace(training, train_iters=iters, train_samples=args.train_samples)


_LOSS_SCALE_FLAGS = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")


def _warn_loss_scale_ignored(args: argparse.Namespace, precision: str) -> None:
    given = [d for d in _LOSS_SCALE_FLAGS if getattr(args, d) is not None]
    if given and precision != "fp16":
        warn(f"{', '.join(map(flag_of, given))} only apply with --fp16; ignored with {precision}")


def _warn_logging_ignored(args: argparse.Namespace) -> None:
    if args.log_progress and not args.save:
        warn("--log-progress writes <--save>/progress.txt; ignored without --save")
    if not args.wandb_project:
        given = [d for d in ("wandb_exp_name", "wandb_save_dir", "wandb_entity") if getattr(args, d)]
        if given:
            warn(f"{', '.join(map(flag_of, given))} need --wandb-project; ignored without it")
    if args.tensorboard_dir is not None or args.wandb_project:
        return
    defaults = LoggingConfig()
    ignored = [
        f.name
        for f in dataclasses.fields(LoggingConfig)
        if f.name.endswith("_tensorboard") and getattr(args, f.name) != getattr(defaults, f.name)
    ]
    if ignored:
        warn(f"{', '.join(map(flag_of, ignored))} need --tensorboard-dir or --wandb-project; ignored without them")


def _optimizer_config(
    args: argparse.Namespace, direct: dict[str, Any], training: TrainingConfig, seq_length: int
) -> OptimizerConfig:
    if args.lr is None and not args.print_layout:
        raise ConfigError("missing --lr; give the peak learning rate, e.g. --lr 3e-4")
    # --print-layout needs no learning rate: stand in with --min-lr, which OptimizerConfig accepts
    lr = args.lr if args.lr is not None else args.min_lr
    gbs = training.global_batch_size
    sizes = training if training.varies else None
    wd_samples = 0
    if args.weight_decay_incr_style != "constant":
        wd_samples = step_flags.weight_decay_incr_samples(args, gbs, train_length(args, gbs, seq_length, sizes)[1])
    return OptimizerConfig(
        **direct,
        lr=lr,
        clip_grad=json_default(args, "clip_grad"),
        weight_decay_incr_style=args.weight_decay_incr_style,
        weight_decay_incr_samples=wd_samples,
        **schedule_lengths(args, gbs, seq_length, sizes),
    )


def build_config(args: argparse.Namespace, world_size: int | None = None, machine: Machine | None = None) -> Config:
    """Map the parsed flags onto the config tree (which checks itself), then check what `machine`
    cannot run and the layout (`run_layout.check_layout`: without a machine, layouts that depend on
    the device are checked when the run resolves its layout). An error names the flags as given
    (Megatron-LM's `--expert-model-parallel-size` where it was given)."""
    try:
        return _build_config(args, world_size, machine)
    except ConfigError as err:
        raise megatron_lm_moe.as_given(err, args) from None


def _build_config(args: argparse.Namespace, world_size: int | None, machine: Machine | None) -> Config:
    _refuse_values(args)
    direct = direct_values(args)
    model = build_model_config(args, direct.get("model", {}))
    parallel = _parallel_config(args, direct.get("parallel", {}), world_size)
    training = _training_config(args, direct.get("training", {}), parallel, model)
    _warn_logging_ignored(args)
    model_flags.check_loss_options(args)
    model_flags.check_logging_options(args, training.zero_stage)
    model_flags.format_notices(args)
    logging = LoggingConfig(**direct.get("logging", {}), **profiler_flags.profiler_fields(args))
    profiler_flags.warn_ignored(args, logging, warn)
    config = Config(
        model=model,
        regularization=RegularizationConfig(**direct.get("regularization", {})),
        parallel=parallel,
        data=data_config(args, direct.get("data", {})),
        optimizer=_optimizer_config(args, megatron_lm_moe.optimizer_fields(model, direct), training, model.seq_length),
        training=training,
        checkpoint=CheckpointConfig(**direct.get("checkpoint", {})),
        logging=logging,
        distillation=distillation_config(args, direct.get("distillation", {}), warn),
    )
    checkpointing_flags.checkpoint_notices(config, machine)
    warning = None if machine is None else dry_run.runs_on_warning(config, machine, args.print_layout)
    if warning:
        warn(warning)
    try:
        check_layout(config, machine if machine is None else for_layout(config, machine))  # fail fast
    except LayoutError as err:
        raise _as_given(err, args, config.parallel.pp_dedicated_embedding_stages) from None
    _moe_clip_notice(config)
    megatron_lm_moe.router_notices(args, config.model, config.training.precision)
    return config


def _moe_clip_notice(config: Config) -> None:
    """The clip of a mixture-of-experts run where it differs from Megatron-DeepSpeed's: fp32 without ZeRO over several
    data-parallel ranks (ZeRO 1/2 and --bf16/--fp16 count each expert once there too, as here)."""
    t, clip = config.training, config.optimizer.clip_grad or 0
    if config.model.is_moe and config.parallel.data_parallel_size > 1 and clip > 0:
        if t.zero_stage == 0 and t.precision == "fp32":
            notice(
                f"--clip-grad {clip:g} with --num-experts: the norm clipped here is the whole "
                f"model's gradient norm (each expert counted once over the expert-parallel group: a one-process run's "
                f"norm); Megatron-DeepSpeed's DeepSpeed clip uses the mean of each data-parallel rank's own norm"
            )


def _as_given(err: LayoutError, args: argparse.Namespace, dedicated: str) -> LayoutError:
    """A layout error about the dedicated stages in the words of the line: --standalone-embedding-stage (folded
    into --pp-dedicated-embedding-stages by `_dedicated_stages`) is named as given, not as the flag it became."""
    if not args.standalone_embedding_stage:
        return err
    given = "--standalone-embedding-stage"
    if args.pp_dedicated_embedding_stages == "post":
        given += " with --pp-dedicated-embedding-stages post"
    return LayoutError(str(err).replace(f"--pp-dedicated-embedding-stages {dedicated}", given))
