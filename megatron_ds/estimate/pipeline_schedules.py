"""Pipeline schedules as data: one registry entry per schedule, the instruction stream each rank runs.

A schedule is what DeepSpeed's `PipeSchedule.steps()` yields: per clock step, the instructions one
rank executes (`schedule_streams` generates them; `Instruction.kind` is the name of the engine's
instruction class, so the runtime maps each one to an `_exec_*` method). Everything else that
depends on the schedule is read off that stream by the functions below, for any entry:

    activations_in_flight   micro-batches whose activations a rank holds at its first and at its
                            fullest later backward (the memory model)
    backward_moments        at each backward: the micro-batches in flight per chunk and the weight
                            passes pending (the memory model under ZB-H1 and interleaving)
    distinct_moments        the first backward and every distinct later `Moment` (backwards and
                            weight passes, with the gradients that exist then): the memory model
    pipe_buffers            the engine's buffer slots per rank (the memory model)
    forward_micro_batches   which micro-batch each forward of a rank runs (dropout reseeding)
    compute_order           (F/B/I/W, chunk, micro-batch) per compute instruction (tests compare it
                            with torch.distributed.pipelining's generators)
and `step_simulator` replays the streams of all ranks to time a step (the fastest layout search,
the stage timers' report, the planner; also each schedule's bubble and idle share).

The 1F1B entry reproduces `deepspeed.runtime.pipe.schedule.TrainSchedule` instruction for
instruction, ZB-H1 Megatron-DeepSpeed's `ZeroBubbleH1Pipeline` with exact semantics, and
interleaved the order of torch's `ScheduleInterleaved1F1B` (tests/unit/test_pipeline_schedules.py
compares them for many sizes), without importing torch or DeepSpeed: the estimate layer imports
neither. Adding a schedule is one `PipelineSchedule` here (its stream in `schedule_streams`), its
name in `config.parallel.PIPELINE_SCHEDULES`, and its runtime in `training/pipe_schedules.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_ds.config.parallel import INTERLEAVED, PIPELINE_SCHEDULES
from megatron_ds.estimate import schedule_streams as streams
from megatron_ds.estimate.schedule_streams import (  # noqa: F401 - the kinds, re-exported for readers
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARDS,
    COMPUTE,
    FORWARD,
    LOAD,
    OPTIMIZER,
    RECEIVES,
    RECV_ACTIVATION,
    RECV_GRAD,
    REDUCE_GRADS,
    REDUCE_TIED,
    SEND_ACTIVATION,
    SEND_GRAD,
    SENDS,
    WEIGHT,
    Instruction,
    Steps,
)


@dataclass(frozen=True)
class PipelineSchedule:
    """One pipeline schedule (`--pp-schedule`), with its virtual stages per rank."""

    name: str
    label: str
    """How reports name it (`1F1B`)."""
    summary: str
    bubble_formula: str
    """The bubble over the ideal step with equal stages, as its paper writes it (reports quote it)."""
    generate: Callable[[int, int, int, int], Steps]
    """(micro-batches M, ranks P, rank s, virtual stages v) -> the rank's instructions per clock step."""
    buffers: Callable[[int, int, int, int], int]
    """(M, P, s, v) -> the engine's activation buffer slots on rank s."""
    blocking_sends: bool = True
    """A send waits for its receive (DeepSpeed's p2p.send); False: posted, waited for at the step's end."""
    splits_backward: bool = False
    """Backwards run as an input-gradient pass and a later weight pass (BackwardOnlyPass, WeightPass)."""
    virtual: bool = False
    """Takes v >= 2 model chunks per rank (`virtual_stages`); otherwise v is 1."""
    virtual_stages: int = 1
    steady: bool = False
    """Beyond M = 2P + 2 micro-batches more only repeat the steady state's backward moment (same micro-batches in
    flight, same weight passes pending): warm-up and drain depend on P and s alone (`distinct_moments`)."""
    last_stage_path: Callable[[Sequence[float], Sequence[float], Sequence[float], int, float], float] | None = None
    """(forward, backward, weight per stage, M, send) -> the length of one path of the replay through the last
    stage (`step_bounds.last_stage_path_bound`, the planner's bound); None: not derived."""
    steady_rounds: bool = False
    """With M a multiple of P, beyond M = 3P micro-batches more rounds of P only repeat the moments of the
    middle rounds (torch's interleaved order; `distinct_moments`)."""

    def steps(self, num_micro_batches: int, num_stages: int, stage: int) -> Steps:
        """The rank's instructions per clock step (`num_stages` is P, the ranks of the pipeline)."""
        return _steps(self, num_micro_batches, num_stages, stage)

    def instructions(self, num_micro_batches: int, num_stages: int, stage: int) -> tuple[Instruction, ...]:
        """The rank's stream, flattened in execution order."""
        return _flat(self, num_micro_batches, num_stages, stage)

    def num_pipe_buffers(self, num_micro_batches: int, num_stages: int, stage: int) -> int:
        return self.buffers(num_micro_batches, num_stages, stage, self.virtual_stages)

    def check(self, num_micro_batches: int, num_stages: int) -> str | None:
        """Why this schedule cannot run M micro-batches on P ranks, or None."""
        if self.virtual:
            return streams.check_interleaved(num_micro_batches, num_stages, self.virtual_stages)
        return None

    @property
    def display(self) -> str:
        """The label with v (`interleaved 1F1B (v=2)`)."""
        return f"{self.label} (v={self.virtual_stages})" if self.virtual else self.label


@functools.lru_cache(maxsize=8192)  # per rank, for every (M, P, schedule) the planner prices
def _steps(schedule: PipelineSchedule, m: int, p: int, s: int) -> Steps:
    problem = schedule.check(m, p)
    assert problem is None, (schedule.name, m, p, problem)
    return schedule.generate(m, p, s, schedule.virtual_stages)


@functools.lru_cache(maxsize=8192)
def _flat(schedule: PipelineSchedule, m: int, p: int, s: int) -> tuple[Instruction, ...]:
    return tuple(ins for step in schedule.steps(m, p, s) for ins in step)


REGISTRY: dict[str, PipelineSchedule] = {
    s.name: s
    for s in (
        PipelineSchedule(
            "1f1b",
            "1F1B",
            "DeepSpeed's TrainSchedule: P - s forwards, then one backward and one forward in turn; "
            "a bubble of (P - 1) / (M + P - 1) of the step",
            "(p-1)/m, Narayanan et al. 2021 eq. 1",
            streams.one_f_one_b,
            streams.one_f_one_b_buffers,
            steady=True,
            last_stage_path=streams.one_f_one_b_last_path,
        ),
        PipelineSchedule(
            "zbh1",
            "ZB-H1",
            "zero bubble H1 (Qi et al. 2024; Megatron-DeepSpeed's --enable-zbh1-pipeline with exact semantics): "
            "1F1B with each backward split into its input and weight gradients, stage s deferring s weight "
            "passes into the drain; 1F1B's peak activations, about a third of its bubble",
            "(p-1)(F+B-W) of time, Qi et al. 2024 sec. 3.1",
            streams.zero_bubble_h1,
            streams.zero_bubble_h1_buffers,
            blocking_sends=False,
            splits_backward=True,
            steady=True,
            last_stage_path=streams.zero_bubble_h1_last_path,
        ),
        PipelineSchedule(
            "interleaved",
            "interleaved 1F1B",
            "v model chunks per rank (--num-virtual-stages-per-pipeline-rank, or a layout of k x P stages): "
            "a bubble of (P - 1) / (v M) at v times the point-to-point traffic",
            "(p-1)/(v m), Narayanan et al. 2021 sec. 2.2",
            streams.interleaved,
            streams.interleaved_buffers,
            blocking_sends=False,
            virtual=True,
            virtual_stages=2,
            steady_rounds=True,
        ),
    )
}
assert tuple(REGISTRY) == PIPELINE_SCHEDULES, "config.parallel.PIPELINE_SCHEDULES must list the registry's names"
assert [s.name for s in REGISTRY.values() if s.virtual] == [INTERLEAVED], "config.parallel.INTERLEAVED names it"


def find(name: str, virtual_stages: int | None = None) -> PipelineSchedule:
    """The registry entry of `name` (a ParallelConfig holds only registered names), for
    `virtual_stages` chunks per rank where the schedule takes them (None: its default)."""
    entry = REGISTRY[name]
    if virtual_stages is None or virtual_stages == entry.virtual_stages:
        return entry
    assert entry.virtual, f"{name} runs one stage per rank, not {virtual_stages}"
    return dataclasses.replace(entry, virtual_stages=virtual_stages)


@functools.lru_cache(maxsize=8192)  # read per stage for every configuration the planner prices
def activations_in_flight(
    schedule: PipelineSchedule, num_micro_batches: int, num_stages: int, stage: int
) -> tuple[int, int]:
    """(at the first backward, at the fullest later backward): micro-batches whose forward has run
    and whose backward (input gradient) has not, over all chunks, counted as each backward starts.
    With no later backward, one fewer than at the first (the first's own activations are gone)."""
    first_at, later = distinct_moments(schedule, num_micro_batches, num_stages, stage)
    first = sum(first_at[0])
    return first, max((sum(m.flight) for m in later if m.kind != WEIGHT), default=first - 1)


@functools.lru_cache(maxsize=8192)  # read per rank for every configuration the planner prices
def backward_moments(
    schedule: PipelineSchedule, num_micro_batches: int, num_stages: int, stage: int
) -> tuple[tuple[tuple[int, ...], int, int], ...]:
    """At each backward (whole or input gradient) as it starts: (micro-batches in flight per chunk,
    weight passes pending, the backward's chunk), in stream order."""
    flight = [0] * schedule.virtual_stages
    pending = 0
    out = []
    for ins in schedule.instructions(num_micro_batches, num_stages, stage):
        if ins.kind == FORWARD:
            flight[ins.chunk] += 1
        elif ins.kind in BACKWARDS:
            out.append((tuple(flight), pending, ins.chunk))
            flight[ins.chunk] -= 1
            pending += ins.kind == BACKWARD_INPUT
        elif ins.kind == WEIGHT:
            pending -= 1
    return tuple(out)


@dataclass(frozen=True)
class Moment:
    """A later moment of a rank's step as the memory model reads it: a backward (whole or input gradient) as
    it starts, or a weight pass as it ends (its stored backward's inputs and output gradients are released
    only after its last weight gradient, `model/weight_grad.py`)."""

    kind: str
    """BACKWARD, BACKWARD_INPUT (a split backward: the linears' weight gradients wait) or WEIGHT."""
    flight: tuple[int, ...]
    """Per chunk: micro-batches whose forward has run and whose backward has not."""
    pending: int
    """Backwards whose weight passes' stores are alive (a weight pass's own included)."""
    backward_grads: tuple[int, ...]
    """The chunks whose backward-made gradients exist (a backward ran before): under a split backward the
    norms, biases and embeddings; under a whole one every gradient."""
    weight_grads: tuple[int, ...]
    """The chunks whose weight gradients (of the linears a split backward defers) exist: a whole backward ran
    before, or a weight pass before or now."""
    accumulating: bool
    """The gradients this moment makes already exist: one of them is created before it is added."""


@functools.lru_cache(maxsize=8192)  # read per rank for every configuration the planner prices
def distinct_moments(
    schedule: PipelineSchedule, num_micro_batches: int, num_stages: int, stage: int
) -> tuple[tuple[tuple[int, ...], int, int], tuple[Moment, ...]]:
    """`backward_moments` as the memory model reads it: (the first moment, every later `Moment`, weight
    passes included) with repeats dropped, first occurrences kept in stream order (a maximum over them is the
    maximum over all, the first one on ties). A `steady` schedule's stream is read at M = 2P + 2 when M is
    larger, a `steady_rounds` one's at M = 3P when M is a larger multiple of P: the same list, without
    generating M's (tests/unit/test_pipeline_schedules.py compares the two)."""
    m, p = num_micro_batches, num_stages
    if schedule.steady and m > 2 * p + 2:
        return distinct_moments(schedule, 2 * p + 2, p, stage)
    if schedule.steady_rounds and m % p == 0 and m > 3 * p:
        return distinct_moments(schedule, 3 * p, p, stage)
    return stream_moments(schedule, num_micro_batches, num_stages, stage)


def stream_moments(
    schedule: PipelineSchedule, num_micro_batches: int, num_stages: int, stage: int
) -> tuple[tuple[tuple[int, ...], int, int], tuple[Moment, ...]]:
    """`distinct_moments` read off the whole stream of M micro-batches."""
    flight = [0] * schedule.virtual_stages
    pending: list[int] = []  # the chunk of each backward whose weight pass waits, oldest first
    backward: set[int] = set()
    weight: set[int] = set()
    first, later = None, {}
    for ins in schedule.instructions(num_micro_batches, num_stages, stage):
        if ins.kind == FORWARD:
            flight[ins.chunk] += 1
        elif ins.kind in BACKWARDS:
            if first is None:
                first = (tuple(flight), len(pending), ins.chunk)
            else:
                made = backward if ins.kind == BACKWARD_INPUT else backward & weight
                moment = Moment(
                    ins.kind, tuple(flight), len(pending), tuple(sorted(backward)), tuple(sorted(weight)),
                    ins.chunk in made,
                )  # fmt: skip
                later.setdefault(moment, None)
            flight[ins.chunk] -= 1
            backward.add(ins.chunk)
            if ins.kind == BACKWARD_INPUT:
                pending.append(ins.chunk)
            else:
                weight.add(ins.chunk)
        elif ins.kind == WEIGHT:
            chunk = pending[0]
            moment = Moment(
                WEIGHT, tuple(flight), len(pending), tuple(sorted(backward)), tuple(sorted(weight | {chunk})),
                chunk in weight,
            )  # fmt: skip
            later.setdefault(moment, None)
            pending.pop(0)
            weight.add(chunk)
    assert first is not None, (schedule.name, num_micro_batches, num_stages, stage)
    return first, tuple(later)


def pipe_buffers(schedule: PipelineSchedule, num_micro_batches: int, num_stages: int, stage: int) -> int:
    """The engine's buffer slots on `stage`."""
    return schedule.num_pipe_buffers(num_micro_batches, num_stages, stage)


def forward_micro_batches(
    schedule: PipelineSchedule, num_micro_batches: int, num_stages: int, stage: int
) -> tuple[int, ...]:
    """The micro-batch of each forward `stage` runs in a step, in order (over its chunks)."""
    return tuple(
        i.micro_batch for i in schedule.instructions(num_micro_batches, num_stages, stage) if i.kind == FORWARD
    )


COMPUTE_LETTERS = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "I", WEIGHT: "W"}
"""torch.distributed.pipelining's action letters (`_ComputationType`)."""


def compute_order(
    schedule: PipelineSchedule, num_micro_batches: int, num_stages: int, stage: int
) -> tuple[tuple[str, int, int], ...]:
    """(letter, flat stage, micro-batch) of each compute instruction in order, as torch's per-rank
    action lists write them (`2F0`: flat stage 2, forward, micro-batch 0)."""
    return tuple(
        (COMPUTE_LETTERS[i.kind], i.chunk * num_stages + stage, i.micro_batch)
        for i in schedule.instructions(num_micro_batches, num_stages, stage)
        if i.kind in COMPUTE
    )
