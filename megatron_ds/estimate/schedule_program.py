"""The dependency graph of one pipeline step, compiled from every rank's instruction stream (the
registry's, `pipeline_schedules`), for `step_simulator` to time. Pure: no torch.

Model of the instructions (deepspeed/runtime/pipe/schedule.py, engine.py, p2p.py; our
`training/zero_bubble.py` and `training/interleaved.py`):
  ForwardPass / BackwardPass   the forward / backward time of one micro-batch on the flat stage
                               (chunk * P + rank) the instruction runs
  BackwardOnlyPass / WeightPass  the input-gradient part (backward - weight) / the weight part
  SendActivation -> RecvActivation of the next rank, SendGrad -> RecvGrad of the previous one:
                               with blocking sends (DeepSpeed's `p2p.send/recv` call `dist.send/recv`)
                               a rendezvous: both sides wait for each other, then both spend `send`;
                               with posted sends (interleaved) the sender goes on at once and the
                               receive waits for the send, then spends `send`; messages between
                               two ranks arrive in the order sent, activations and gradients apart
  ReduceTiedGrads              all-reduce of the tied embedding's gradient between the first and the
                               last rank (only the tied ranks take part): both wait, then `tied_reduce`
  OptimizerStep                with gradient clipping the global norm is all-reduced over every
                               rank first (`grad_norm_sync`: a barrier), then the rank's `optimizer`
  ReduceGrads                  the rank's data-parallel gradient reduction, its own `reduce_grads` (the
                               other ranks run on; the norm barrier then waits for it)
  LoadMicroBatch               no time of its own

Each rank's order is fixed by the schedule and every wait is for a fixed predecessor, so the
finish times are the longest paths of one graph; it depends only on the schedule, M and P and is
built once (`program`), then evaluated for any durations in O(M P v).
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass

from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.estimate import pipeline_schedules as schedules

# Node kinds of the compiled program.
FORWARD, BACKWARD, SEND, TIED, BARRIER, OPTIMIZER, BACKWARD_INPUT, WEIGHT, POST, REDUCE = range(10)
COMPUTE_NODES = {
    schedules.FORWARD: FORWARD,
    schedules.BACKWARD: BACKWARD,
    schedules.BACKWARD_INPUT: BACKWARD_INPUT,
    schedules.WEIGHT: WEIGHT,
}
PEER = {
    schedules.SEND_ACTIVATION: ("send", +1, "activation"),
    schedules.RECV_ACTIVATION: ("recv", -1, "activation"),
    schedules.SEND_GRAD: ("send", -1, "gradient"),
    schedules.RECV_GRAD: ("recv", +1, "gradient"),
}
NO_TIME = (schedules.LOAD,)
"""Instructions with no time of their own."""


@dataclass(frozen=True)
class Program:
    """The dependency graph of one step: nodes in an order where predecessors come first."""

    num_micro_batches: int
    num_stages: int
    """Ranks P."""
    virtual_stages: int
    nodes: tuple[tuple[int, tuple[int, ...], tuple[int, ...], int], ...]
    """(kind, ranks taking part, predecessor node indices, flat stage of a compute node else -1)."""
    last: tuple[int, ...]
    """Per rank: its last node."""
    order: tuple[tuple[int, ...], ...]
    """Per rank: its compute node kinds in order."""

    @property
    def num_flat(self) -> int:
        return self.num_stages * self.virtual_stages

    @functools.cached_property
    def comm_counts(self) -> tuple[tuple[int, int], ...]:
        """Per rank: (sends and receives it spends time in, tied all-reduces it takes part in)."""
        counts = [[0, 0] for _ in range(self.num_stages)]
        for kind, ranks, _, _ in self.nodes:  # one pass: the planner reads it for every program it prices
            if kind in (SEND, TIED):
                for s in ranks:
                    counts[s][kind == TIED] += 1
        return tuple((a, b) for a, b in counts)

    @functools.cached_property
    def flat(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """(first predecessor, second predecessor, duration slot) per flat node, and each node's flat
        position, for the simulator's loop. A node with more than two predecessors (the barrier)
        becomes a chain of zero-time joins; a missing predecessor points at a sentinel that
        finishes at 0. Duration slots: `slots`."""
        n, p = self.num_flat, self.num_stages
        block = {FORWARD: 0, BACKWARD: n, BACKWARD_INPUT: 2 * n, WEIGHT: 3 * n}
        zero = 4 * n + 2 * p + 2
        fixed = {SEND: 4 * n + 2 * p, TIED: 4 * n + 2 * p + 1}
        first: list[int] = []
        second: list[int] = []
        durations: list[int] = []
        index: list[int] = []  # node -> its flat position (the chain's last)
        add_first, add_second, add_duration, add_index = first.append, second.append, durations.append, index.append
        for kind, ranks, preds, stage in self.nodes:  # one pass per program: the planner's hottest loop
            if len(preds) <= 2:
                a = index[preds[0]] if preds else -1
                add_first(a)
                add_second(index[preds[-1]] if preds else a)
            else:
                mapped = [index[j] for j in preds]
                while len(mapped) > 2:  # fold extra predecessors into zero-time joins
                    add_first(mapped.pop())
                    add_second(mapped.pop())
                    add_duration(zero)
                    mapped.append(len(first) - 1)
                add_first(mapped[0])
                add_second(mapped[-1])
            base = block.get(kind)
            if base is not None:
                add_duration(base + stage)
            elif kind == OPTIMIZER:
                add_duration(4 * n + ranks[0])
            elif kind == REDUCE:
                add_duration(4 * n + p + ranks[0])
            else:
                add_duration(fixed.get(kind, zero))
            add_index(len(first) - 1)
        return first, second, durations, index


def slots(num_flat: int, num_ranks: int) -> dict[str, int]:
    """Where each duration sits in the simulator's weight vector: forward, backward, input-gradient
    and weight passes per flat stage, the optimizer and the data-parallel reduction per rank, then send,
    tied all-reduce and zero."""
    n, p = num_flat, num_ranks
    return {
        "forward": 0,
        "backward": n,
        "input": 2 * n,
        "weight": 3 * n,
        "optimizer": 4 * n,
        "reduce": 4 * n + p,
        "send": 4 * n + 2 * p,
    }


def _tokens(schedule: schedules.PipelineSchedule, m: int, p: int, rank: int) -> list[tuple]:
    """The rank's stream as tokens: (node kind, flat stage), (send/recv, peer, tag), (tied,), (opt,)."""
    tokens: dict[tuple[str, int], tuple | None] = {}  # (kind, chunk) -> token: it names neither buffer nor micro-batch
    out: list[tuple] = []
    for ins in schedule.instructions(m, p, rank):
        key = (ins.kind, ins.chunk)
        if key not in tokens:
            tokens[key] = _token(ins, p, rank)
        token = tokens[key]
        if token is not None:
            out.append(token)
    return out


def _token(ins: schedules.Instruction, p: int, rank: int) -> tuple | None:
    """One instruction's token (None: no time of its own)."""
    if ins.kind in COMPUTE_NODES:
        return (COMPUTE_NODES[ins.kind], ins.chunk * p + rank)
    if ins.kind in PEER:
        way, step, tag = PEER[ins.kind]
        return (way, (rank + step) % p, tag)
    if ins.kind == schedules.REDUCE_TIED:
        return ("tied",)
    if ins.kind == schedules.OPTIMIZER:
        return ("opt",)
    if ins.kind == schedules.REDUCE_GRADS:
        return ("reduce",)
    assert ins.kind in NO_TIME, ins
    return None


@functools.lru_cache(maxsize=256)
def program(
    num_micro_batches: int,
    num_stages: int,
    tied: bool = True,
    grad_norm_sync: bool = True,
    schedule: str = DEFAULT_PIPELINE_SCHEDULE,
    virtual_stages: int | None = None,
) -> Program:
    """Compile the P ranks' instruction streams into one dependency graph (raises on a deadlock)."""
    if num_micro_batches < 1 or num_stages < 1:
        raise ValueError(f"need >= 1 micro-batch and stage, got {num_micro_batches}, {num_stages}")
    entry = schedules.find(schedule, virtual_stages)
    p = num_stages
    stream = [_tokens(entry, num_micro_batches, p, s) for s in range(p)]
    tied_ranks = {0, p - 1} if tied and p > 1 else set()
    pos, last = [0] * p, [-1] * p
    nodes: list[tuple[int, tuple[int, ...], tuple[int, ...], int]] = []
    posted: dict[tuple[int, int, str], deque[int]] = {}  # (from, to, tag) -> posted send nodes

    single = [(s,) for s in range(p)]

    def add(kind: int, ranks: tuple[int, ...], stage: int = -1, extra: tuple[int, ...] = ()) -> None:
        if len(ranks) == 1:  # most nodes: one rank's own instruction
            s = ranks[0]
            before = last[s]
            nodes.append((kind, ranks, ((before,) if before >= 0 else ()) + extra, stage))
            last[s] = len(nodes) - 1
            pos[s] += 1
            return
        nodes.append((kind, ranks, tuple(last[s] for s in ranks if last[s] >= 0) + extra, stage))
        for s in ranks:
            last[s], pos[s] = len(nodes) - 1, pos[s] + 1

    def head(s: int) -> tuple | None:
        return stream[s][pos[s]] if pos[s] < len(stream[s]) else None

    def step(s: int, op: tuple) -> bool:
        """Issue `op` on rank s if it can run now."""
        if isinstance(op[0], int):
            add(op[0], single[s], op[1])
        elif op[0] in ("send", "recv") and entry.blocking_sends:
            if head(op[1]) != ("recv" if op[0] == "send" else "send", s, op[2]):
                return False  # rendezvous: wait until the peer reaches the matching instruction
            add(SEND, tuple(sorted((s, op[1]))))
        elif op[0] == "send":  # posted: the sender goes on
            add(POST, single[s])
            posted.setdefault((s, op[1], op[2]), deque()).append(len(nodes) - 1)
        elif op[0] == "recv":
            queue = posted.get((op[1], s, op[2]))
            if not queue:
                return False
            add(SEND, single[s], extra=(queue.popleft(),))
        elif op[0] == "reduce":
            add(REDUCE, (s,))
        elif op[0] == "tied":
            if s not in tied_ranks:
                pos[s] += 1
            elif all(head(t) == ("tied",) for t in tied_ranks):
                add(TIED, tuple(sorted(tied_ranks)))
            else:
                return False
        elif grad_norm_sync and p > 1:  # opt: the global norm's all-reduce joins every rank
            if not all(head(t) == ("opt",) for t in range(p)):
                return False
            add(BARRIER, tuple(range(p)))
            for t in range(p):
                pos[t] -= 1  # the barrier consumed nothing; each rank's step follows it
            for t in range(p):
                add(OPTIMIZER, (t,))
        else:
            add(OPTIMIZER, (s,))
        return True

    # Each rank runs ahead until it waits; the graph (every node's predecessors) is the same in any issue
    # order: a rank's nodes follow its stream, a transfer pairs the k-th send and the k-th receive of its channel.
    while True:
        progressed = live = False
        for s in range(p):
            ops, n = stream[s], len(stream[s])
            while pos[s] < n:
                op = ops[pos[s]]
                if isinstance(op[0], int):  # a compute node, the rank's own: `add` inlined (most nodes)
                    before = last[s]
                    nodes.append((op[0], single[s], (before,) if before >= 0 else (), op[1]))
                    last[s] = len(nodes) - 1
                    pos[s] += 1
                elif not step(s, op):
                    break
                progressed = True
            live = live or pos[s] < n
        if not live and all(head(s) is None for s in range(p)):
            break
        assert progressed, f"{entry.display}({num_micro_batches}, {p}) deadlocks at {[head(s) for s in range(p)]}"
    order = tuple(tuple(op[0] for op in st if isinstance(op[0], int)) for st in stream)
    return Program(num_micro_batches, p, entry.virtual_stages, tuple(nodes), tuple(last), order)
