"""Pipeline schedules as data: one registry entry per schedule, the instruction stream each stage runs.

A schedule is what DeepSpeed's `PipeSchedule.steps()` yields: per clock step, the instructions one
stage executes (`Instruction.kind` is the name of DeepSpeed's instruction class, so the runtime maps
each one to the engine's `_exec_*` method). Everything else that depends on the schedule is read
off that stream by the functions below, for any entry:

    activations_in_flight   micro-batches whose activations a stage holds at its first and at its
                            fullest later backward (the memory model)
    pipe_buffers            the engine's buffer slots per stage (the memory model)
    forward_micro_batches   which micro-batch each forward of a stage runs (dropout reseeding)
    idle_fraction           the share of clock steps a stage computes nothing (the planner)
and `step_simulator` replays the streams of all stages to time a step (the fastest layout search,
the stage timers' report, the planner).

The 1F1B entry reproduces `deepspeed.runtime.pipe.schedule.TrainSchedule` instruction for
instruction (tests/unit/test_pipeline_schedules.py compares them for many sizes), without
importing DeepSpeed: the estimate layer imports neither torch nor DeepSpeed. Adding a schedule is
one `PipelineSchedule` here, its name in `config.parallel.PIPELINE_SCHEDULES`, and its runtime in
`training/pipe_schedules.py` (the engine's side).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from megatron_ds.config.parallel import PIPELINE_SCHEDULES

# Instruction kinds: DeepSpeed's class names (deepspeed/runtime/pipe/schedule.py).
LOAD = "LoadMicroBatch"
FORWARD = "ForwardPass"
BACKWARD = "BackwardPass"
SEND_ACTIVATION = "SendActivation"
RECV_ACTIVATION = "RecvActivation"
SEND_GRAD = "SendGrad"
RECV_GRAD = "RecvGrad"
REDUCE_TIED = "ReduceTiedGrads"
REDUCE_GRADS = "ReduceGrads"
OPTIMIZER = "OptimizerStep"
COMPUTE = (FORWARD, BACKWARD)


@dataclass(frozen=True)
class Instruction:
    """One instruction of one stage; `buffer` is the pipe-buffer slot it uses (None for the step's end)."""

    kind: str
    buffer: int | None = None
    micro_batch: int | None = None
    """The micro-batch a load, forward or backward runs (and the one a send or receive carries)."""


Steps = tuple[tuple[Instruction, ...], ...]
"""Per clock step, the stage's instructions in order."""


@dataclass(frozen=True)
class PipelineSchedule:
    """One pipeline schedule (`--pp-schedule`)."""

    name: str
    label: str
    """How reports name it (`1F1B`)."""
    summary: str
    bubble_formula: str
    """The bubble over the ideal step with equal stages, as its paper writes it (reports quote it)."""
    steps: Callable[[int, int, int], Steps]
    """(micro-batches M, stages P, stage s) -> the stage's instructions per clock step."""
    num_pipe_buffers: Callable[[int, int, int], int]
    """(M, P, s) -> the engine's activation buffer slots on stage s."""

    def instructions(self, num_micro_batches: int, num_stages: int, stage: int) -> tuple[Instruction, ...]:
        """The stage's stream, flattened in execution order."""
        return _flat(self, num_micro_batches, num_stages, stage)


@functools.lru_cache(maxsize=256)
def _flat(schedule: PipelineSchedule, m: int, p: int, s: int) -> tuple[Instruction, ...]:
    return tuple(ins for step in schedule.steps(m, p, s) for ins in step)


def _1f1b_buffers(num_micro_batches: int, num_stages: int, stage: int) -> int:
    """`TrainSchedule.num_pipe_buffers()`: the forwards stage s runs before its first backward
    (at least two slots)."""
    return max(2, min(num_stages - stage, num_micro_batches))


def _1f1b_micro_batch(step: int, num_stages: int, stage: int) -> tuple[int, bool]:
    """(micro-batch, is forward) of clock step `step` on `stage`: even stages run forwards on even
    steps, odd stages on odd steps, and the backward of micro-batch j on stage s comes P - s - 1
    forwards after its forward (TrainSchedule's `_step_to_micro_batch`)."""
    half = step // 2
    if step % 2 == stage % 2:
        return half - stage // 2, True
    if step % 2 == 0:  # odd stage, even step
        return half - num_stages + (stage + 1) // 2, False
    return half - num_stages + 1 + stage // 2, False  # even stage, odd step


def _1f1b_steps(num_micro_batches: int, num_stages: int, stage: int) -> Steps:
    """DeepSpeed's TrainSchedule: 2(M + P - 1) clock steps; each sends the previous step's result
    before receiving, loads on the first and last stage, then computes; the last ends the batch."""
    m, p = num_micro_batches, num_stages
    buffers = _1f1b_buffers(m, p, stage)
    total = 2 * (m + p - 1)
    valid = range(m).__contains__
    prev, out = -1, []
    for step in range(total):
        mb, forward = _1f1b_micro_batch(step, p, stage)
        cmds: list[Instruction] = []
        if forward:
            if valid(prev) and stage > 0:
                cmds.append(Instruction(SEND_GRAD, prev % buffers, prev))
            if valid(mb) and stage > 0:
                cmds.append(Instruction(RECV_ACTIVATION, mb % buffers, mb))
        else:
            if valid(mb) and stage < p - 1:
                cmds.append(Instruction(RECV_GRAD, mb % buffers, mb))
            if valid(prev) and stage < p - 1:
                cmds.append(Instruction(SEND_ACTIVATION, prev % buffers, prev))
        if stage in (0, p - 1) and forward and valid(mb):
            cmds.append(Instruction(LOAD, mb % buffers, mb))
        if valid(mb):
            cmds.append(Instruction(FORWARD if forward else BACKWARD, mb % buffers, mb))
        if step == total - 1:
            cmds += [Instruction(REDUCE_TIED), Instruction(REDUCE_GRADS), Instruction(OPTIMIZER)]
        prev = mb
        out.append(tuple(cmds))
    return tuple(out)


REGISTRY: dict[str, PipelineSchedule] = {
    s.name: s
    for s in (
        PipelineSchedule(
            "1f1b",
            "1F1B",
            "DeepSpeed's TrainSchedule: P - s forwards, then one backward and one forward in turn; "
            "a bubble of (P - 1) / (M + P - 1) of the step",
            "(p-1)/m, Narayanan et al. 2021 eq. 1",
            _1f1b_steps,
            _1f1b_buffers,
        ),
    )
}
assert tuple(REGISTRY) == PIPELINE_SCHEDULES, "config.parallel.PIPELINE_SCHEDULES must list the registry's names"


def find(name: str) -> PipelineSchedule:
    """The registry entry of `name` (a ParallelConfig holds only registered names)."""
    return REGISTRY[name]


@functools.lru_cache(maxsize=8192)  # read per stage for every configuration the planner prices
def activations_in_flight(
    schedule: PipelineSchedule, num_micro_batches: int, num_stages: int, stage: int
) -> tuple[int, int]:
    """(at the first backward, at the fullest later backward): micro-batches whose forward has run
    and whose backward has not, counted as each backward starts. With no later backward, one fewer
    than at the first (the first's own activations are gone)."""
    done_forward = done_backward = 0
    at_backward: list[int] = []
    for ins in schedule.instructions(num_micro_batches, num_stages, stage):
        if ins.kind == FORWARD:
            done_forward += 1
        elif ins.kind == BACKWARD:
            at_backward.append(done_forward - done_backward)
            done_backward += 1
    first = at_backward[0]
    return first, max(at_backward[1:], default=first - 1)


def pipe_buffers(schedule: PipelineSchedule, num_micro_batches: int, num_stages: int, stage: int) -> int:
    """The engine's buffer slots on `stage`."""
    return schedule.num_pipe_buffers(num_micro_batches, num_stages, stage)


def forward_micro_batches(
    schedule: PipelineSchedule, num_micro_batches: int, num_stages: int, stage: int
) -> tuple[int, ...]:
    """The micro-batch of each forward `stage` runs in a step, in order."""
    return tuple(
        i.micro_batch for i in schedule.instructions(num_micro_batches, num_stages, stage) if i.kind == FORWARD
    )


def clock_steps(schedule: PipelineSchedule, num_micro_batches: int, num_stages: int, stage: int = 0) -> tuple[int, int]:
    """(clock steps of the schedule, those in which `stage` runs a forward or backward)."""
    steps = schedule.steps(num_micro_batches, num_stages, stage)
    return len(steps), sum(1 for step in steps if any(i.kind in COMPUTE for i in step))


def idle_fraction(schedule: PipelineSchedule, num_micro_batches: int, num_stages: int, stage: int = 0) -> float:
    """The share of the schedule's clock steps in which `stage` runs no forward or backward."""
    total, busy = clock_steps(schedule, num_micro_batches, num_stages, stage)
    return 1.0 - busy / total


def bubble_ratio(schedule: PipelineSchedule, num_micro_batches: int, num_stages: int, stage: int = 0) -> float:
    """Idle clock steps over busy ones: with equal stages, the bubble time over the ideal step time
    (1F1B: (p - 1) / m)."""
    total, busy = clock_steps(schedule, num_micro_batches, num_stages, stage)
    return (total - busy) / busy
