"""Step time of a pipeline schedule, simulated over the instruction streams its engine runs.

`simulate(M, forward, backward, ...)` replays a registered schedule's instructions
(`pipeline_schedules`; 1F1B is DeepSpeed's `TrainSchedule(M, P, s)`) on every rank, one device per
rank, each rank running its instructions in order as `PipelineEngine._exec_schedule` does, over the
dependency graph `schedule_program.program` compiles (its docstring says how each instruction is
timed), and returns when the step ends and how busy each rank was.

Times are per flat stage: P values, or v x P for interleaving (flat stage c * P + r is chunk c of
rank r, megatron-core's numbering). `weight[i]` is the part of `backward[i]` that is weight gradients:
a schedule that splits backwards (ZB-H1) runs backward - weight as the input-gradient pass and
weight in a later weight pass; one that does not runs the whole backward.

`bubble_ratio` and `idle_fraction` are each schedule's bubble on equal stages with the paper's unit
costs (forward 1, backward 2 of which weight 1): (P - 1) / M for 1F1B, (P - 1) / (v M) interleaved,
(P - 1)(F + B - W) / (M (F + B + W)) = (P - 1) / (3 M) for ZB-H1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.estimate.schedule_program import (  # noqa: F401 - node kinds, re-exported for tests
    BACKWARD,
    FORWARD,
    Program,
    program,
    slots,
)
from megatron_ds.pipeline.costs import StageTime, StepEstimate


@dataclass(frozen=True)
class ScheduleResult:
    """One simulated training step (times in the units of the inputs)."""

    step_time: float
    busy: tuple[float, ...]
    """Per rank: forward + backward + optimizer time."""
    comm: tuple[float, ...]
    """Per rank: time in sends, receives, the tied all-reduce and its data-parallel gradient reduction."""
    finish: tuple[float, ...]
    """Per rank: when its last instruction ends."""
    path: tuple[tuple[int, int, int, int], ...] = ()
    """A critical (longest) path: per flat stage, the coefficients of its forward, backward,
    optimizer and weight times on it (an input-gradient pass counts backward + 1 and weight - 1).
    Its length, these times the stage times plus `path_constant`, is `step_time`; for any other
    times it is a lower bound of the step (it is still a path)."""
    path_constant: float = 0.0
    """The communication time (sends, tied all-reduce, gradient reductions) on that path."""

    @property
    def idle(self) -> tuple[float, ...]:
        """Per rank: the step time it spends waiting (bubble)."""
        return tuple(self.step_time - b - c for b, c in zip(self.busy, self.comm))


def _per_stage(value: float | Sequence[float], n: int, name: str) -> tuple[float, ...]:
    values = (float(value),) * n if isinstance(value, (int, float)) else tuple(float(v) for v in value)
    if len(values) != n or min(values) < 0:
        raise ValueError(f"{name}: need {n} non-negative values, got {value}")
    return values


def simulate(
    num_micro_batches: int,
    forward: Sequence[float],
    backward: Sequence[float],
    optimizer: float | Sequence[float] = 0.0,
    send: float = 0.0,
    tied_reduce: float = 0.0,
    tied: bool = True,
    grad_norm_sync: bool = True,
    schedule: str = DEFAULT_PIPELINE_SCHEDULE,
    weight: float | Sequence[float] = 0.0,
    virtual_stages: int = 1,
    reduce_grads: float | Sequence[float] = 0.0,
) -> ScheduleResult:
    """One step of `schedule` (DeepSpeed's TrainSchedule for 1F1B) with one device per rank.

    `forward[i]` / `backward[i]`: one micro-batch on flat stage i (backward including recomputation
    and `weight[i]`, its weight gradients); `optimizer`: per flat stage (summed per rank) or one value
    for all; `send`: one activation or gradient transfer; `tied`: the first and last stage share the
    tied word embedding (False for an untied head); `virtual_stages`: v chunks per rank (len(forward)
    is v x P); `reduce_grads`: per rank (or one value), the part of its data-parallel gradient reduction
    that the step waits for.
    """
    n = len(forward)
    v = virtual_stages
    if n % v:
        raise ValueError(f"{n} stage times do not split into {v} chunks per rank")
    p = n // v
    fwd, bwd = _per_stage(forward, n, "forward"), _per_stage(backward, n, "backward")
    wgt = _per_stage(weight, n, "weight")
    if any(w > b for w, b in zip(wgt, bwd)):
        raise ValueError(f"weight: {wgt} exceeds the backward {bwd}")
    opt = _per_stage(optimizer, n, "optimizer")
    rank_opt = [sum(opt[c * p + r] for c in range(v)) for r in range(p)]
    red = _per_stage(reduce_grads, p, "reduce_grads")
    prog = program(num_micro_batches, p, tied, grad_norm_sync, schedule, v)
    first, second, durations, index = prog.flat
    weights = [
        *fwd,
        *bwd,
        *(b - w for b, w in zip(bwd, wgt)),
        *wgt,
        *rank_opt,
        *red,
        float(send),
        float(tied_reduce),
        0.0,
    ]
    finish = [0.0] * (len(first) + 1)  # finish[-1]: the sentinel "no predecessor"
    for i, (a, b, d) in enumerate(zip(first, second, durations)):
        fa, fb = finish[a], finish[b]
        finish[i] = (fa if fa > fb else fb) + weights[d]
    ends = tuple(finish[index[j]] for j in prog.last)
    path, constant = _critical_path(prog, finish, durations, weights)
    comm = tuple(n_send * send + n_tied * tied_reduce + r for (n_send, n_tied), r in zip(prog.comm_counts, red))
    m = num_micro_batches
    busy = tuple(sum(m * (fwd[c * p + r] + bwd[c * p + r]) for c in range(v)) + rank_opt[r] for r in range(p))
    return ScheduleResult(step_time=max(ends), busy=busy, comm=comm, finish=ends, path=path, path_constant=constant)


def _critical_path(
    prog: Program, finish: list[float], durations: list[int], weights: list[float]
) -> tuple[tuple[tuple[int, int, int, int], ...], float]:
    """Walk back from the latest node through the predecessor that finished last."""
    first, second, _, index = prog.flat
    n, p, v = prog.num_flat, prog.num_stages, prog.virtual_stages
    at = slots(n, p)
    counts = [[0, 0, 0, 0] for _ in range(n)]  # forward, backward, optimizer, weight
    constant = 0.0
    i = max((index[j] for j in prog.last), key=lambda j: finish[j])
    while i >= 0:
        d = durations[i]
        if d < at["input"]:
            counts[d % n][d // n] += 1  # forward (block 0) or backward (block 1)
        elif d < at["weight"]:
            counts[d - at["input"]][1] += 1  # backward - weight
            counts[d - at["input"]][3] -= 1
        elif d < at["optimizer"]:
            counts[d - at["weight"]][3] += 1
        elif d < at["reduce"]:
            for c in range(v):  # the rank's optimizer time is its chunks' sum
                counts[c * p + d - at["optimizer"]][2] += 1
        else:
            constant += weights[d]
        a, b = first[i], second[i]
        i = a if finish[a] >= finish[b] else b
    return tuple(tuple(c) for c in counts), constant


def balanced_step_time(
    num_micro_batches: int,
    forward: Sequence[float],
    backward: Sequence[float],
    schedule: str = DEFAULT_PIPELINE_SCHEDULE,
    weight: float | Sequence[float] = 0.0,
    virtual_stages: int = 1,
) -> float:
    """The ideal: the same total work split evenly over the stages, through the same schedule."""
    n = len(forward)
    wgt = _per_stage(weight, n, "weight")
    mean_f, mean_b, mean_w = sum(forward) / n, sum(backward) / n, sum(wgt) / n
    return _equal_stages(num_micro_batches, n, (mean_f, mean_b, mean_w), schedule, virtual_stages).step_time


def _equal_stages(
    num_micro_batches: int,
    num_flat_stages: int,
    passes: tuple[float, float, float],
    schedule: str,
    virtual_stages: int,
    shared: bool = True,
) -> ScheduleResult:
    """`simulate` on `num_flat_stages` (v x P) stages of the same (forward, backward, weight) `passes`;
    `shared` False: no tied embedding and no gradient-norm sync either."""
    forward, backward, weight = passes
    return simulate(
        num_micro_batches,
        [forward] * num_flat_stages,
        [backward] * num_flat_stages,
        tied=shared,
        grad_norm_sync=shared,
        schedule=schedule,
        weight=weight,
        virtual_stages=virtual_stages,
    )


def step_estimator(
    num_micro_batches: int,
    send: float = 0.0,
    tied_reduce: float = 0.0,
    tied: bool = True,
    grad_norm_sync: bool = True,
    schedule: str = DEFAULT_PIPELINE_SCHEDULE,
    virtual_stages: int = 1,
) -> Callable[[Sequence[StageTime]], StepEstimate]:
    """The `step_time` of `megatron_ds.pipeline.fastest`: this schedule's step for per-stage times,
    with its critical path as the lower-bound certificate the search prunes with."""

    def estimate(times: Sequence[StageTime]) -> StepEstimate:
        result = simulate(
            num_micro_batches,
            [t.forward for t in times],
            [t.backward for t in times],
            [t.optimizer for t in times],
            send=send,
            tied_reduce=tied_reduce,
            tied=tied,
            grad_norm_sync=grad_norm_sync,
            schedule=schedule,
            weight=[t.weight for t in times],
            virtual_stages=virtual_stages,
        )
        return StepEstimate(result.step_time, result.path, result.path_constant)

    return estimate


UNIT_FORWARD, UNIT_BACKWARD, UNIT_WEIGHT = 1.0, 2.0, 1.0
"""The papers' equal-cost passes: F = B = W, a whole backward 2F."""


@functools.lru_cache(maxsize=256)
def _unit_step(schedule: str, num_micro_batches: int, num_stages: int, virtual_stages: int) -> ScheduleResult:
    passes = (UNIT_FORWARD / virtual_stages, UNIT_BACKWARD / virtual_stages, UNIT_WEIGHT / virtual_stages)
    return _equal_stages(num_micro_batches, num_stages * virtual_stages, passes, schedule, virtual_stages, False)


def bubble_ratio(schedule: str, num_micro_batches: int, num_stages: int, virtual_stages: int = 1) -> float:
    """The bubble time over the ideal step on equal stages with unit passes (module docstring)."""
    result = _unit_step(schedule, num_micro_batches, num_stages, virtual_stages)
    ideal = num_micro_batches * (UNIT_FORWARD + UNIT_BACKWARD)
    return (result.step_time - ideal) / ideal


def idle_fraction(schedule: str, num_micro_batches: int, num_stages: int, virtual_stages: int = 1) -> float:
    """The share of the step a rank idles on equal stages with unit passes (1F1B: (P - 1) / (M + P - 1))."""
    result = _unit_step(schedule, num_micro_batches, num_stages, virtual_stages)
    return 1.0 - num_micro_batches * (UNIT_FORWARD + UNIT_BACKWARD) / result.step_time
