"""DeepSpeed's activation-checkpointing flags, as Megatron-DeepSpeed 4efb479 reads them.

Its `megatron/initialize.py` calls `deepspeed.checkpointing.configure(mpu, partition_activations=...,
contiguous_checkpointing=..., checkpoint_in_cpu=..., synchronize=..., profile=...)` only under
`--deepspeed --deepspeed-activation-checkpointing`, and only recomputed chunks go through that function.
So here the five flags take effect under `--deepspeed-activation-checkpointing` with recomputation on
(`training.activation_checkpointing` configures DeepSpeed with them); elsewhere they change nothing, as
upstream, and a NOTICE says so. What cannot work is refused by the config tree
(`TrainingConfig._check_checkpoint_options`, `Config._check_partitioned_checkpoints`).
"""

from __future__ import annotations

import argparse

from megatron_ds.config import Config
from megatron_ds.estimate.machine import Machine
from megatron_ds.flags.declare import Flag, flag_of, switch
from megatron_ds.flags.notices import notice

_DS = "DeepSpeed, ZeRO, recompute"
_UNDER = " (with --deepspeed-activation-checkpointing and full recomputation)"

FLAGS: tuple[Flag, ...] = (
    switch(
        "--partition-activations",
        _DS,
        "each tensor rank keeps 1/T of every recomputed chunk's input and all-gathers it for the recompute" + _UNDER,
        "training.partition_activations",
        derived=True,
    ),
    switch(
        "--contigious-checkpointing",
        _DS,
        "partitioned checkpoints go into buffers DeepSpeed allocates once, as many as the stage keeps at its "
        "fullest; needs --partition-activations" + _UNDER,
        "training.contiguous_checkpointing",
        derived=True,
    ),
    switch(
        "--checkpoint-in-cpu",
        _DS,
        "recomputed chunks' inputs wait in host memory for their recompute" + _UNDER,
        "training.checkpoint_in_cpu",
        derived=True,
    ),
    switch(
        "--synchronize-each-layer",
        _DS,
        "the device is synchronized before and after every checkpointed call (with "
        "--deepspeed-activation-checkpointing and recomputation)",
        "training.synchronize_each_layer",
        derived=True,
    ),
    switch(
        "--profile-backward",
        _DS,
        "DeepSpeed's timers log every checkpointed call's forward and backward time (with "
        "--deepspeed-activation-checkpointing and recomputation)",
        "training.profile_backward",
        derived=True,
    ),
)

FIELDS: dict[str, str] = {
    "partition_activations": "partition_activations",
    "contigious_checkpointing": "contiguous_checkpointing",
    "checkpoint_in_cpu": "checkpoint_in_cpu",
    "synchronize_each_layer": "synchronize_each_layer",
    "profile_backward": "profile_backward",
}
"""argparse dest -> TrainingConfig field."""
FULL_ONLY = ("partition_activations", "contigious_checkpointing", "checkpoint_in_cpu")
"""The dests that configure full recomputation's checkpoints only (refused with selective recomputation)."""


def checkpoint_options(args: argparse.Namespace, full: bool, selective: bool) -> dict[str, bool]:
    """TrainingConfig's checkpointing fields from the flags: as given under --deepspeed-activation-checkpointing
    with recomputation on; off with a NOTICE where Megatron-DeepSpeed would not configure DeepSpeed with them."""
    given = [d for d in FIELDS if getattr(args, d)]
    off = dict.fromkeys(FIELDS.values(), False)
    if not given:
        return off
    shown = " and ".join(map(flag_of, given))
    verb = "changes" if len(given) == 1 else "change"
    if not args.deepspeed_activation_checkpointing:
        notice(
            f"{shown} {verb} nothing without --deepspeed-activation-checkpointing: Megatron-DeepSpeed configures "
            f"deepspeed.checkpointing with them only under it; add --deepspeed-activation-checkpointing"
        )
        return off
    if not (full or selective):
        notice(
            f"{shown} {verb} nothing: no layer is recomputed; add --checkpoint-activations (or "
            f"--recompute-granularity full --recompute-method uniform)"
        )
        return off
    return {FIELDS[d]: bool(getattr(args, d)) for d in FIELDS}


def checkpoint_notices(config: Config, machine: Machine | None) -> None:
    """NOTICEs for options that change nothing on this run, as upstream runs them anyway: partitioning at T = 1,
    and on a CPU device the host copy and the device synchronizations."""
    t = config.training
    size = config.parallel.tensor_model_parallel_size
    if t.partition_activations and size == 1:
        notice(
            "--partition-activations changes nothing at --tensor-model-parallel-size 1: DeepSpeed partitions each "
            "checkpoint over the tensor-parallel group, so one rank keeps all of it"
        )
    if machine is None or machine.device != "cpu":
        return
    if t.checkpoint_in_cpu:
        notice(
            "--checkpoint-in-cpu changes nothing on a CPU device: the checkpoints are in host memory already (it is not "
            "passed to DeepSpeed there)"
        )
    if t.synchronize_each_layer:
        notice("--synchronize-each-layer changes nothing on a CPU device: there is no device queue to wait for")
