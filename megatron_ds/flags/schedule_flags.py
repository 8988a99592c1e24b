"""Flags -> the pipeline schedule and its virtual stages (`parallel.pipeline_schedule`,
`parallel.virtual_stages`), from every upstream's spelling:

    --pp-schedule NAME                       ours: any registered schedule
    --enable-zbh1-pipeline                   Megatron-DeepSpeed's ZB-H1 (= --pp-schedule zbh1)
    --enable-zbh1-exact-semantics            Megatron-DeepSpeed: its exact variant (needs the above)
    --num-virtual-stages-per-pipeline-rank V Megatron-LM: V model chunks per rank (interleaved)
    --num-layers-per-virtual-pipeline-stage N  Megatron-DeepSpeed / Megatron-LM: V = layers per rank / N
    a layout string of V x P stages          megatron-core's virtual stages (interleaved)

ZB-H1 always runs with exact semantics (the same gradients as 1F1B, summed in the same order);
without `--enable-zbh1-exact-semantics` Megatron-DeepSpeed runs a variant that splits fewer
backwards and sums some weight gradients in another order, and a NOTICE says so. Virtual stages
above 1 select the interleaved schedule. At most one of Megatron-LM's three ways to give them.
"""

from __future__ import annotations

import argparse

from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE, INTERLEAVED
from megatron_ds.errors import ConfigError
from megatron_ds.estimate import pipeline_schedules
from megatron_ds.flags.notices import notice
from megatron_ds.pipeline import layout_string, megatron_lm

ZBH1 = "--enable-zbh1-pipeline"
EXACT = "--enable-zbh1-exact-semantics"
PER_STAGE = "--num-layers-per-virtual-pipeline-stage"
ZERO_BUBBLE = next(s.name for s in pipeline_schedules.REGISTRY.values() if s.splits_backward)
"""The schedule --enable-zbh1-pipeline selects: the registry's one that splits backwards (ZB-H1)."""


def pipeline_schedule(args: argparse.Namespace) -> tuple[str, int]:
    """(schedule name, virtual stages per rank) the flags ask for."""
    if args.enable_zbh1_exact_semantics and not args.enable_zbh1_pipeline:
        raise ConfigError(f"{EXACT} needs {ZBH1} (as in Megatron-DeepSpeed); add it or drop {EXACT}")
    name, virtual = named_schedule(args.pp_schedule, args.enable_zbh1_pipeline, virtual_stages(args))
    if args.enable_zbh1_pipeline and not args.enable_zbh1_exact_semantics:
        notice(
            f"{ZBH1} runs ZB-H1 with exact semantics here (as with {EXACT}): every backward after stage 0's "
            f"is split, and each weight gets 1F1B's gradients summed in 1F1B's order; Megatron-DeepSpeed's "
            f"default variant splits fewer backwards and sums some weight gradients in another order"
        )
    return name or DEFAULT_PIPELINE_SCHEDULE, virtual


def named_schedule(given: str | None, zbh1: bool, virtual: int) -> tuple[str | None, int]:
    """(schedule, virtual stages) that `--pp-schedule` (`given`), `--enable-zbh1-pipeline` and V virtual stages
    per rank name together; the schedule None when they name none. Refuses the combinations no schedule runs
    (the planner's `--pp-schedule` flags go through here too)."""
    if zbh1:
        if given not in (None, ZERO_BUBBLE):
            raise ConfigError(f"{ZBH1} and --pp-schedule {given} were both given; keep one")
        if virtual > 1:
            raise ConfigError(
                f"{ZBH1} with {virtual} virtual stages per rank: ZB-H1 runs one stage per rank here (interleaved "
                f"zero-bubble schedules are not implemented); drop {ZBH1} or the virtual stages"
            )
        return ZERO_BUBBLE, 1
    if virtual > 1:
        if given not in (None, INTERLEAVED):
            raise ConfigError(
                f"{virtual} virtual stages per rank run only on the interleaved schedule, not --pp-schedule {given}; "
                f"use --pp-schedule {INTERLEAVED} or one stage per rank"
            )
        return INTERLEAVED, virtual
    return given, virtual


def virtual_stages(args: argparse.Namespace) -> int:
    """V from --num-virtual-stages-per-pipeline-rank, a layout string of V x P stages or
    --num-layers-per-virtual-pipeline-stage (1 without any)."""
    p = args.pipeline_model_parallel_size
    given = [
        flag
        for flag, value in (
            (megatron_lm.VIRTUAL, args.num_virtual_stages_per_pipeline_rank),
            (megatron_lm.LAYOUT, args.pipeline_model_parallel_layout),
            (PER_STAGE, args.num_layers_per_virtual_pipeline_stage),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} were both given; Megatron-LM takes one of them: keep one")
    if args.num_virtual_stages_per_pipeline_rank is not None:
        if args.num_virtual_stages_per_pipeline_rank < 1:
            raise ConfigError(f"{megatron_lm.VIRTUAL} must be >= 1, got {args.num_virtual_stages_per_pipeline_rank}")
        return args.num_virtual_stages_per_pipeline_rank
    layout = args.pipeline_model_parallel_layout or args.pp_layout
    if layout is not None and layout != "auto" and p >= 1:
        stages = layout_string.count_stages(layout)
        if p == 1 and stages > 1:  # not virtual stages: interleaving needs two ranks or more
            flag = megatron_lm.LAYOUT if args.pipeline_model_parallel_layout else "--pp-layout"
            raise ConfigError(
                f"{flag} {layout!r} has {stages} stages but --pipeline-model-parallel-size is 1; give "
                f"--pipeline-model-parallel-size {stages} (a divisor of it from 2 up makes virtual stages), or a one-stage layout"
            )
        return stages // p if stages % p == 0 else 1  # the layout check names a count that does not divide
    if args.num_layers_per_virtual_pipeline_stage is not None:
        return _from_layers_per_stage(args)
    return 1


def _from_layers_per_stage(args: argparse.Namespace) -> int:
    """Megatron-LM's rule: (layers + embedding and loss when accounted for) / P layers per rank,
    split in chunks of N."""
    n, p = args.num_layers_per_virtual_pipeline_stage, args.pipeline_model_parallel_size
    layers = (
        args.num_layers
        + int(args.account_for_embedding_in_pipeline_split)
        + int(args.account_for_loss_in_pipeline_split)
    )
    if n < 1 or layers % p or (layers // p) % n:
        raise ConfigError(
            f"{PER_STAGE} {n} with --num-layers {args.num_layers} on --pipeline-model-parallel-size {p}: each rank "
            f"must hold a whole number of chunks of {n} layers ({layers} / {p} per rank); choose N dividing "
            f"{layers // p if layers % p == 0 else layers / p}, or give --num-virtual-stages-per-pipeline-rank"
        )
    return layers // p // n
