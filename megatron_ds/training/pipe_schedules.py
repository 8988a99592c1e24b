"""The engine's side of each pipeline schedule: the DeepSpeed `PipeSchedule` that runs it.

`estimate/pipeline_schedules.py` describes each registered schedule as data (the instruction
stream per stage) for the estimates; this table names the generator DeepSpeed's `PipelineEngine`
executes for it, and `engine_stream` reads that generator's output back as (kind, buffer) pairs,
so a test can check the two streams are one (tests/unit/test_pipeline_schedules.py). `1f1b` is
DeepSpeed's own `TrainSchedule`, which `PipelineEngine.train_batch` builds itself.
"""

from __future__ import annotations

from deepspeed.runtime.pipe import schedule as ds

ENGINE_SCHEDULES: dict[str, type[ds.PipeSchedule]] = {"1f1b": ds.TrainSchedule}
"""Schedule name -> the DeepSpeed generator the engine runs (in registry order)."""


def engine_schedule(name: str) -> type[ds.PipeSchedule]:
    """The DeepSpeed schedule class of `name` (every registered name has one)."""
    return ENGINE_SCHEDULES[name]


def engine_stream(name: str, num_micro_batches: int, num_stages: int, stage: int) -> list[list[tuple[str, int | None]]]:
    """Per clock step, (instruction class name, buffer slot) of what the engine runs on `stage`."""
    sched = engine_schedule(name)(micro_batches=num_micro_batches, stages=num_stages, stage_id=stage)
    return [[(type(cmd).__name__, getattr(cmd, "buffer_id", None)) for cmd in step] for step in sched.steps()]
