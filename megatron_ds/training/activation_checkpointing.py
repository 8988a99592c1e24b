"""DeepSpeed's activation checkpointing configured from the config, as Megatron-DeepSpeed configures it.

Recomputation always goes through `deepspeed.checkpointing.checkpoint` (GPTModelPipe's chunks,
GPTModel's on the plain engine, selective recomputation's core attention). Megatron-DeepSpeed's
`setup_deepspeed_random_and_activation_checkpointing` (megatron/initialize.py) calls
`deepspeed.checkpointing.configure(mpu, partition_activations=..., contiguous_checkpointing=...,
num_checkpoints=..., checkpoint_in_cpu=..., synchronize=..., profile=...)` under
`--deepspeed-activation-checkpointing`; `configure` here makes the same call with the config's options
(`--partition-activations` ...; `flags/checkpointing_flags.py` says when they are on), and:

* `num_checkpoints`, the slot count of DeepSpeed's contiguous buffers (it allocates that many per
  checkpointed input at the first checkpoint and indexes past them otherwise), is what this rank keeps
  at its fullest: the checkpointed calls between two backwards that recompute, read off the schedule's
  instruction stream (`checkpoint_slots`). Upstream passes num_layers / checkpoint_num_layers, which a
  stage holding more than its share of layers, with micro-batches in flight, can overrun.
* Only a backward empties DeepSpeed's buffers. An evaluation runs forwards alone: DeepSpeed's pipeline
  engine calls `reset()` after each of them itself, its plain engine (`PlainEngine`, ZeRO 2/3 at P = 1)
  does not, and its forwards would overrun the slots. So `reset()` runs before and after every forward
  of a module in eval mode, whichever engine: an eval interval neither overruns the slots nor leaves its
  checkpoints to the training step after it.
* The module's state is global: every build configures it (back to DeepSpeed's defaults when no
  option is on and an earlier build in this process changed them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_ds.config import Config
from megatron_ds.estimate import pipeline_schedules
from megatron_ds.pipeline.layout import Layout


@dataclass(frozen=True)
class CheckpointOptions:
    """What `deepspeed.checkpointing.configure` is given (its keyword names)."""

    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: int = 0
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False

    @property
    def changes_defaults(self) -> bool:
        """Whether any option differs from deepspeed.checkpointing's defaults (num_checkpoints matters only then)."""
        return self.partition_activations or self.checkpoint_in_cpu or self.synchronize or self.profile


def checkpoint_calls(num_pre: int, num_layers: int, num_post: int, interval: int) -> int:
    """Checkpointed calls of one forward of a stage of `num_pre` functions, `num_layers` transformer layers and
    `num_post` functions: PipelineModule.forward cuts the stage's functions into chunks of `interval` from local
    index 0 and checkpoints a chunk only when all of it is transformer layers (`stage_contents.checkpointed_chunks`)."""
    if interval <= 0 or num_layers <= 0:
        return 0
    start = -(-num_pre // interval) * interval  # the first chunk boundary at or after the first layer
    end = num_pre + num_layers
    if start >= end:
        return 0
    whole, rest = divmod(end - start, interval)
    return whole + (1 if rest and num_post == 0 else 0)


def chunk_calls(config: Config, layout: Layout, rank: int) -> tuple[int, ...]:
    """Checkpointed calls of one forward of each of `rank`'s model chunks (one without interleaving)."""
    t = config.training
    interval = t.checkpoint_num_layers if t.checkpoint_activations else 0
    first = len(layout.groups.pre)
    end = first + sum(layout.layers_per_stage)
    out = []
    for stage in layout.rank_stages(rank):
        specs = layout.stage_specs(stage)
        pre, post = sum(1 for i in specs if i < first), sum(1 for i in specs if i >= end)
        out.append(checkpoint_calls(pre, layout.layers_per_stage[stage], post, interval))
    return tuple(out)


def checkpoint_slots(config: Config, layout: Layout, rank: int) -> int:
    """The most checkpointed calls `rank` makes between two backwards that recompute (each such backward empties
    DeepSpeed's contiguous buffers), over every step size the batch schedule reaches: the slots it needs."""
    calls = chunk_calls(config, layout, rank)
    if config.engine_kind == "plain" or not any(calls):  # the plain engine: forward, backward, one at a time
        return calls[0] if calls else 0
    par = config.parallel
    schedule = pipeline_schedules.find(par.pipeline_schedule, par.virtual_stages)
    per_micro = config.training.micro_batch_size * par.data_parallel_size
    counts = {b // per_micro for b in (config.training.global_batch_size, *config.training.batch_sizes())}
    most = 0
    for m in sorted(counts):
        held = 0
        for ins in schedule.instructions(m, layout.num_ranks, rank):
            if ins.kind == pipeline_schedules.FORWARD:
                held += calls[ins.chunk]
                most = max(most, held)
            elif ins.kind in pipeline_schedules.BACKWARDS and calls[ins.chunk]:
                held = 0  # CheckpointFunction.backward drops every buffer (the in-flight ones stay referenced)
    return most


def options(config: Config, layout: Layout, rank: int, device: str) -> CheckpointOptions:
    """This rank's `configure` keywords on `device` (the accelerator's name: `cuda`, `cpu`).

    On a CPU device `--checkpoint-in-cpu` changes nothing (a NOTICE says so) and is not passed on: DeepSpeed's
    unpartitioned host copy (`copy_to_device`) is then the input tensor itself, which it empties right after
    (`get_cpu_activations_for_backward`), so the recompute would find nothing."""
    t = config.training
    return CheckpointOptions(
        partition_activations=t.partition_activations,
        contiguous_checkpointing=t.contiguous_checkpointing,
        num_checkpoints=checkpoint_slots(config, layout, rank),
        checkpoint_in_cpu=t.checkpoint_in_cpu and device != "cpu",
        synchronize=t.synchronize_each_layer,
        profile=t.profile_backward,
    )


@dataclass(frozen=True)
class _TensorParallelMpu:
    """The three calls of Megatron's mpu that `deepspeed.checkpointing.configure` reads: the tensor-parallel group
    it partitions over."""

    tp: Any  # model.tensor_parallel.TensorParallel

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp.rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp.size

    def get_tensor_model_parallel_group(self) -> Any:
        return self.tp.group


def configure(config: Config, layout: Layout, engine: Any, tp: Any) -> CheckpointOptions:
    """Configure deepspeed.checkpointing for this rank (`engine.stage_id` under the pipeline engine) and keep eval
    forwards out of its buffers; returns what it was given."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing import checkpointing

    rank = engine.stage_id if config.engine_kind == "pipeline" else 0
    opts = options(config, layout, rank, get_accelerator().device_name())
    if opts.changes_defaults or checkpointing.deepspeed_checkpointing_enabled:
        checkpointing.configure(
            _TensorParallelMpu(tp),
            partition_activations=opts.partition_activations,
            contiguous_checkpointing=opts.contiguous_checkpointing,
            num_checkpoints=opts.num_checkpoints,
            checkpoint_in_cpu=opts.checkpoint_in_cpu,
            synchronize=opts.synchronize,
            profile=opts.profile,
        )
        checkpointing.reset()  # an earlier build's buffers
    if opts.changes_defaults:
        _reset_around_eval_forwards(engine.module, checkpointing.reset)
    return opts


def _reset_around_eval_forwards(module: Any, reset: Any) -> None:
    """DeepSpeed's `reset()` before and after each forward of `module` in eval mode (see the module docstring)."""

    def around(mod: Any, *_: Any) -> None:
        if not mod.training:
            reset()

    module.register_forward_pre_hook(around)
    module.register_forward_hook(around)
