"""Step time of a pipeline schedule, simulated over the instruction stream its engine runs.

`simulate(M, forward, backward, ...)` replays a registered schedule's instructions
(`pipeline_schedules`; 1F1B is DeepSpeed's `TrainSchedule(M, P, s)`) for every stage s, one device
per stage, each stage running its instructions in order as `PipelineEngine._exec_schedule` does,
and returns when the step ends and how busy each stage was.

Model of the instructions (deepspeed/runtime/pipe/schedule.py, engine.py, p2p.py):
  ForwardPass / BackwardPass   the stage's forward / backward time of one micro-batch
  SendActivation -> RecvActivation of the next stage, SendGrad -> RecvGrad of the previous one:
                               blocking point-to-point (`p2p.send/recv` call `dist.send/recv`), a
                               rendezvous: both sides wait for each other, then both spend `send`
  ReduceTiedGrads              all-reduce of the tied embedding's gradient between the first and the
                               last stage (`allreduce_tied_weight_gradients`; only the tied ranks
                               take part): both wait for each other, then spend `tied_reduce`
  OptimizerStep                with gradient clipping the global norm is all-reduced over every
                               stage first (`grad_norm_sync`: a barrier), then the stage's `optimizer`
                               time (which should include its ReduceGrads and the update)
  ReduceGrads                  the stage's data-parallel gradient reduction: `reduce_grads` of that stage,
                               its own (the other stages run on; the norm barrier then waits for it)
  LoadMicroBatch               no time of its own
The step ends when every stage has finished (the engine's loss broadcast then joins all stages).

Each stage's order is fixed by the schedule, and every wait is for a fixed predecessor, so the
finish times are the longest paths of one dependency graph; the graph depends only on (M, P) and
is built once (`program`), then evaluated for any durations in O(M P).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.estimate import pipeline_schedules as schedules
from megatron_ds.pipeline.costs import StageTime, StepEstimate

# Node kinds of the compiled program.
FORWARD, BACKWARD, SEND, TIED, BARRIER, OPTIMIZER, REDUCE = range(7)


@dataclass(frozen=True)
class ScheduleResult:
    """One simulated training step (times in the units of the inputs)."""

    step_time: float
    busy: tuple[float, ...]
    """Per stage: forward + backward + optimizer time."""
    comm: tuple[float, ...]
    """Per stage: time in sends, receives, the tied all-reduce and its gradient reduction."""
    finish: tuple[float, ...]
    """Per stage: when its last instruction ends."""
    path: tuple[tuple[int, int, int], ...] = ()
    """A critical (longest) path: per stage, how many of its forwards, backwards and optimizer steps
    lie on it. Its length, these counts times the stage times plus `path_constant`, is `step_time`;
    for any other times it is a lower bound of the step (it is still a path)."""
    path_constant: float = 0.0
    """The communication time (sends, tied all-reduce) on that path."""

    @property
    def idle(self) -> tuple[float, ...]:
        """Per stage: the step time it spends waiting (bubble)."""
        return tuple(self.step_time - b - c for b, c in zip(self.busy, self.comm))


@dataclass(frozen=True)
class Program:
    """The dependency graph of one step: nodes in an order where predecessors come first."""

    num_micro_batches: int
    num_stages: int
    nodes: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]
    """(kind, stages taking part, predecessor node indices)."""
    last: tuple[int, ...]
    """Per stage: its last node."""
    order: tuple[tuple[int, ...], ...]
    """Per stage: its compute kinds in order (FORWARD/BACKWARD)."""

    @functools.cached_property
    def comm_counts(self) -> tuple[tuple[int, int], ...]:
        """Per stage: (sends and receives, tied all-reduces) it takes part in."""
        return tuple(
            (
                sum(1 for k, st, _ in self.nodes if k == SEND and s in st),
                sum(1 for k, st, _ in self.nodes if k == TIED and s in st),
            )
            for s in range(self.num_stages)
        )

    @functools.cached_property
    def flat(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """(first predecessor, second predecessor, duration slot) per flat node, and each node's flat
        position, for `simulate`'s loop. A node with more than two predecessors (the barrier) becomes a chain of
        zero-time nodes; a missing predecessor points at a sentinel that finishes at 0. Duration
        slots index [forward x P, backward x P, optimizer x P, reduce_grads x P, send, tied_reduce, zero]."""
        p = self.num_stages
        slot = {FORWARD: 0, BACKWARD: p, OPTIMIZER: 2 * p, REDUCE: 3 * p}
        zero = 4 * p + 2
        first: list[int] = []
        second: list[int] = []
        durations: list[int] = []
        index: list[int] = []  # node -> its flat position (the chain's last)
        for kind, stages, preds in self.nodes:
            mapped = [index[j] for j in preds] or [-1]
            while len(mapped) > 2:  # fold extra predecessors into zero-time joins
                first.append(mapped.pop())
                second.append(mapped.pop())
                durations.append(zero)
                mapped.append(len(first) - 1)
            first.append(mapped[0])
            second.append(mapped[-1])
            if kind in slot:
                durations.append(slot[kind] + stages[0])
            else:
                durations.append({SEND: 4 * p, TIED: 4 * p + 1, BARRIER: zero}[kind])
            index.append(len(first) - 1)
        return first, second, durations, index


_TOKENS = {
    schedules.FORWARD: lambda stage: ("F",),
    schedules.BACKWARD: lambda stage: ("B",),
    schedules.SEND_ACTIVATION: lambda stage: ("send", stage + 1),
    schedules.RECV_ACTIVATION: lambda stage: ("recv", stage - 1),
    schedules.SEND_GRAD: lambda stage: ("send", stage - 1),
    schedules.RECV_GRAD: lambda stage: ("recv", stage + 1),
    schedules.REDUCE_TIED: lambda stage: ("tied",),
    schedules.OPTIMIZER: lambda stage: ("opt",),
    schedules.REDUCE_GRADS: lambda stage: ("reduce",),
}
NO_TIME = (schedules.LOAD,)
"""Instructions with no time of their own."""


def _instructions(schedule: str, num_micro_batches: int, num_stages: int, stage: int) -> list[tuple]:
    """The stage's stream flattened to tokens: (kind,) or (kind, peer) for communication."""
    tokens: list[tuple] = []
    for ins in schedules.find(schedule).instructions(num_micro_batches, num_stages, stage):
        if ins.kind in _TOKENS:
            tokens.append(_TOKENS[ins.kind](stage))
        else:
            assert ins.kind in NO_TIME, ins
    return tokens


@functools.lru_cache(maxsize=64)
def program(
    num_micro_batches: int,
    num_stages: int,
    tied: bool = True,
    grad_norm_sync: bool = True,
    schedule: str = DEFAULT_PIPELINE_SCHEDULE,
) -> Program:
    """Compile the P instruction streams into one dependency graph (raises on a deadlock)."""
    if num_micro_batches < 1 or num_stages < 1:
        raise ValueError(f"need >= 1 micro-batch and stage, got {num_micro_batches}, {num_stages}")
    p = num_stages
    streams = [_instructions(schedule, num_micro_batches, p, s) for s in range(p)]
    tied_stages = {0, p - 1} if tied and p > 1 else set()
    pos, last = [0] * p, [-1] * p
    nodes: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []

    def add(kind: int, stages: tuple[int, ...]) -> None:
        nodes.append((kind, stages, tuple(last[s] for s in stages if last[s] >= 0)))
        for s in stages:
            last[s], pos[s] = len(nodes) - 1, pos[s] + 1

    def head(s: int) -> tuple | None:
        return streams[s][pos[s]] if pos[s] < len(streams[s]) else None

    while any(head(s) is not None for s in range(p)):
        progressed = False
        for s in range(p):
            op = head(s)
            if op is None:
                continue
            if op[0] in ("F", "B"):
                add(FORWARD if op[0] == "F" else BACKWARD, (s,))
            elif op[0] == "reduce":
                add(REDUCE, (s,))
            elif op[0] in ("send", "recv"):
                peer = op[1]
                if head(peer) != ("recv" if op[0] == "send" else "send", s):
                    continue  # rendezvous: wait until the peer reaches the matching instruction
                add(SEND, tuple(sorted((s, peer))))
            elif op[0] == "tied":
                if s not in tied_stages:
                    pos[s] += 1
                elif all(head(t) == ("tied",) for t in tied_stages):
                    add(TIED, tuple(sorted(tied_stages)))
                else:
                    continue
            elif op[0] == "opt":
                if grad_norm_sync and p > 1:
                    if not all(head(t) == ("opt",) for t in range(p)):
                        continue
                    add(BARRIER, tuple(range(p)))
                    for t in range(p):
                        pos[t] -= 1  # the barrier consumed nothing; each stage's step follows it
                    for t in range(p):
                        add(OPTIMIZER, (t,))
                else:
                    add(OPTIMIZER, (s,))
            progressed = True
        assert progressed, f"{schedule}({num_micro_batches}, {p}) deadlocks at {[head(s) for s in range(p)]}"
    order = tuple(tuple(FORWARD if op[0] == "F" else BACKWARD for op in st if op[0] in ("F", "B")) for st in streams)
    return Program(num_micro_batches, p, tuple(nodes), tuple(last), order)


def _per_stage(value: float | Sequence[float], p: int, name: str) -> tuple[float, ...]:
    values = (float(value),) * p if isinstance(value, (int, float)) else tuple(float(v) for v in value)
    if len(values) != p or min(values) < 0:
        raise ValueError(f"{name}: need {p} non-negative values, got {value}")
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
    reduce_grads: float | Sequence[float] = 0.0,
) -> ScheduleResult:
    """One step of `schedule` (DeepSpeed's TrainSchedule for 1F1B) with one device per stage.

    `forward[s]` / `backward[s]`: one micro-batch on stage s (backward including recomputation);
    `optimizer`: per stage (or one value for all); `send`: one activation or gradient transfer;
    `tied`: the first and last stage share the tied word embedding (False for an untied head);
    `reduce_grads`: per stage (or one value), the part of its data-parallel gradient reduction that the
    step waits for.
    """
    p = len(forward)
    fwd, bwd = _per_stage(forward, p, "forward"), _per_stage(backward, p, "backward")
    opt = _per_stage(optimizer, p, "optimizer")
    red = _per_stage(reduce_grads, p, "reduce_grads")
    prog = program(num_micro_batches, p, tied, grad_norm_sync, schedule)
    first, second, slots, index = prog.flat
    weights = [*fwd, *bwd, *opt, *red, float(send), float(tied_reduce), 0.0]
    finish = [0.0] * (len(first) + 1)  # finish[-1]: the sentinel "no predecessor"
    for i, (a, b, d) in enumerate(zip(first, second, slots)):
        fa, fb = finish[a], finish[b]
        finish[i] = (fa if fa > fb else fb) + weights[d]
    ends = tuple(finish[index[j]] for j in prog.last)
    path, constant = _critical_path(prog, finish, slots, weights)
    comm = tuple(n_send * send + n_tied * tied_reduce + r for (n_send, n_tied), r in zip(prog.comm_counts, red))
    busy = tuple(num_micro_batches * (f + b) + o for f, b, o in zip(fwd, bwd, opt))
    return ScheduleResult(step_time=max(ends), busy=busy, comm=comm, finish=ends, path=path, path_constant=constant)


def _critical_path(
    prog: Program, finish: list[float], slots: list[int], weights: list[float]
) -> tuple[tuple[tuple[int, int, int], ...], float]:
    """Walk back from the latest node through the predecessor that finished last."""
    first, second, _, index = prog.flat
    p = prog.num_stages
    counts = [[0, 0, 0] for _ in range(p)]
    constant = 0.0
    i = max((index[j] for j in prog.last), key=lambda j: finish[j])
    while i >= 0:
        slot = slots[i]
        if slot < 3 * p:
            counts[slot % p][slot // p] += 1  # slot = kind block (forward, backward, optimizer) x P + stage
        else:
            constant += weights[slot]
        a, b = first[i], second[i]
        i = a if finish[a] >= finish[b] else b
    return tuple((f, b, o) for f, b, o in counts), constant


def balanced_step_time(
    num_micro_batches: int,
    forward: Sequence[float],
    backward: Sequence[float],
    schedule: str = DEFAULT_PIPELINE_SCHEDULE,
) -> float:
    """The ideal: the same total work split evenly over the stages, through the same schedule."""
    p = len(forward)
    mean_f, mean_b = sum(forward) / p, sum(backward) / p
    return simulate(num_micro_batches, [mean_f] * p, [mean_b] * p, schedule=schedule).step_time


def step_estimator(
    num_micro_batches: int,
    send: float = 0.0,
    tied_reduce: float = 0.0,
    tied: bool = True,
    grad_norm_sync: bool = True,
    schedule: str = DEFAULT_PIPELINE_SCHEDULE,
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
        )
        return StepEstimate(result.step_time, result.path, result.path_constant)

    return estimate
