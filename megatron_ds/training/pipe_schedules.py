"""The engine's side of each pipeline schedule: the DeepSpeed `PipeSchedule` that runs it.

`estimate/pipeline_schedules.py` describes each registered schedule as data (the instruction
stream per rank) for the estimates; this module names the generator DeepSpeed's engine executes for
it, and `engine_stream` reads that generator's output back as (kind, buffer, chunk) triples, so a
test can check the two streams are one (tests/unit/test_pipeline_schedules.py):

    1f1b         DeepSpeed's own `TrainSchedule`, which `PipelineEngine.train_batch` builds itself
    zbh1         `ZeroBubbleH1Schedule`: the registry's stream (Megatron-DeepSpeed's ZB-H1 with exact
                 semantics, checked against upstream's own generator) as DeepSpeed instructions,
                 with the two Megatron-DeepSpeed adds, `BackwardOnlyPass` and `WeightPass`
    interleaved  `InterleavedSchedule`: the per-rank order torch.distributed.pipelining's
                 `ScheduleInterleaved1F1B` generates (`torch_order`; reused, not rewritten), with the
                 receives, loads and sends of `schedule_streams.place_interleaved`; every instruction
                 names its model chunk (`chunk=`)

`torch_order` also gives torch's ZB-H1 order (`ScheduleInterleavedZeroBubble` with one stage per
rank), which the tests compare with ours.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from deepspeed.runtime.pipe import schedule as ds

from megatron_ds.estimate import pipeline_schedules, schedule_streams
from megatron_ds.estimate.schedule_streams import Instruction, Order


class BackwardOnlyPass(ds.BufferOpInstruction):
    """The input gradient of a backward; its linear layers' weight gradients are stored for a
    `WeightPass` (Megatron-DeepSpeed's instruction of the same name)."""


class WeightPass(ds.PipeInstruction):
    """The stored weight gradients of the oldest `BackwardOnlyPass` (Megatron-DeepSpeed's)."""


INSTRUCTIONS: dict[str, type[ds.PipeInstruction]] = {
    cls.__name__: cls
    for cls in (
        ds.LoadMicroBatch,
        ds.ForwardPass,
        ds.BackwardPass,
        BackwardOnlyPass,
        WeightPass,
        ds.SendActivation,
        ds.RecvActivation,
        ds.SendGrad,
        ds.RecvGrad,
        ds.ReduceTiedGrads,
        ds.ReduceGrads,
        ds.OptimizerStep,
    )
}
"""Registry kind -> the DeepSpeed instruction class the engine's `_INSTRUCTION_MAP` dispatches."""


def to_deepspeed(ins: Instruction, with_chunk: bool) -> ds.PipeInstruction:
    """The DeepSpeed instruction of one registry instruction (its kwargs are the engine method's)."""
    cls = INSTRUCTIONS[ins.kind]
    kwargs: dict[str, Any] = {"chunk": ins.chunk} if with_chunk and ins.buffer is not None else {}
    if issubclass(cls, ds.BufferOpInstruction):
        return cls(ins.buffer, **kwargs)
    return cls(**kwargs)


class _StreamSchedule(ds.PipeSchedule):
    """A DeepSpeed schedule that yields a registered schedule's steps as DeepSpeed instructions."""

    NAME = ""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int = 1) -> None:
        super().__init__(micro_batches, stages, stage_id)
        self.entry = pipeline_schedules.find(self.NAME, virtual_stages if virtual_stages > 1 else None)

    def stream(self) -> schedule_streams.Steps:
        return self.entry.steps(self.micro_batches, self.stages, self.stage_id)

    def steps(self) -> Any:
        for step in self.stream():
            yield [to_deepspeed(ins, self.entry.virtual) for ins in step]

    def num_pipe_buffers(self) -> int:
        return self.entry.num_pipe_buffers(self.micro_batches, self.stages, self.stage_id)


class ZeroBubbleH1Schedule(_StreamSchedule):
    """ZB-H1 on DeepSpeed's engine (`training/zero_bubble.py` runs its two extra instructions)."""

    NAME = "zbh1"


class InterleavedSchedule(_StreamSchedule):
    """Interleaved 1F1B: torch's order, our receives and sends (`training/interleaved.py` runs it)."""

    NAME = "interleaved"

    def stream(self) -> schedule_streams.Steps:
        m, p, r, v = self.micro_batches, self.stages, self.stage_id, self.entry.virtual_stages
        return schedule_streams.place_interleaved(torch_order("interleaved", m, p, r, v), m, p, r, v)


ENGINE_SCHEDULES: dict[str, type[ds.PipeSchedule]] = {
    "1f1b": ds.TrainSchedule,
    "zbh1": ZeroBubbleH1Schedule,
    "interleaved": InterleavedSchedule,
}
"""Schedule name -> the DeepSpeed generator the engine runs (in registry order)."""


def engine_schedule(name: str) -> type[ds.PipeSchedule]:
    """The DeepSpeed schedule class of `name` (every registered name has one)."""
    return ENGINE_SCHEDULES[name]


def build(name: str, num_micro_batches: int, num_stages: int, stage: int, virtual_stages: int = 1) -> ds.PipeSchedule:
    """The engine's schedule object for one step."""
    cls = engine_schedule(name)
    if cls is ds.TrainSchedule:
        return cls(micro_batches=num_micro_batches, stages=num_stages, stage_id=stage)
    return cls(num_micro_batches, num_stages, stage, virtual_stages)


def check_deepspeed_config(name: str, ds_config: dict[str, Any]) -> None:
    """Refuse what the schedule cannot run with (`launch_checks.check_launch` calls it before any process group and
    for --print-layout; the builder again for library callers): a schedule that splits
    backwards adds its weight gradients after the backward, which bf16's `immediate_grad_update`
    (fp32 accumulation in hooks during the backward) would never see."""
    entry = pipeline_schedules.find(name)
    if entry.splits_backward and ds_config.get("bf16", {}).get("immediate_grad_update"):
        from megatron_ds.errors import ConfigError

        raise ConfigError(
            f"--pp-schedule {name} and the DeepSpeed JSON's bf16.immediate_grad_update: true: the deferred weight "
            f"gradients would miss the fp32 accumulation; drop immediate_grad_update"
        )


def engine_stream(
    name: str, num_micro_batches: int, num_stages: int, stage: int, virtual_stages: int = 1
) -> list[list[tuple[str, int | None, int]]]:
    """Per clock step, (instruction class name, buffer slot, chunk) of what the engine runs on `stage`."""
    sched = build(name, num_micro_batches, num_stages, stage, virtual_stages)
    return [
        [(type(cmd).__name__, getattr(cmd, "buffer_id", None), getattr(cmd, "chunk", 0)) for cmd in step]
        for step in sched.steps()
    ]


_TORCH_GENERATORS = {"zbh1": "ScheduleInterleavedZeroBubble", "interleaved": "ScheduleInterleaved1F1B"}


def torch_order(name: str, num_micro_batches: int, num_stages: int, rank: int, virtual_stages: int = 1) -> Order:
    """(F/B/I/W, chunk, micro-batch) in the order torch.distributed.pipelining computes them on `rank`.

    Its generators are methods of schedule objects that need real pipeline stages; the per-rank
    order (`_calculate_single_rank_operations`) reads only four attributes, given here. Its flat
    stage index is chunk * P + rank, as ours.
    """
    from torch.distributed.pipelining import schedules

    m, p = num_micro_batches, num_stages
    rounds = max(1, m // p)
    fake = SimpleNamespace(
        n_local_stages=virtual_stages, microbatches_per_round=m // rounds, pp_group_size=p, _n_microbatches=m
    )
    generator = getattr(schedules, _TORCH_GENERATORS[name])
    actions = generator._calculate_single_rank_operations(fake, rank)
    return [(a.computation_type.value, a.stage_index // p, a.microbatch_index) for a in actions if a is not None]
