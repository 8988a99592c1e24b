"""The instruction streams of the registered pipeline schedules, as data (`pipeline_schedules` is the
registry that names them). Pure: no torch, no DeepSpeed.

A stream is what a DeepSpeed `PipeSchedule.steps()` yields: per clock step, the instructions one
pipeline rank executes; `Instruction.kind` is the name of the instruction class, so the runtime maps
each one to an engine method (`training/pipe_schedules.py`).

    one_f_one_b       DeepSpeed's `TrainSchedule`, instruction for instruction
    zero_bubble_h1    ZB-H1 (Qi et al. 2024) as Megatron-DeepSpeed runs it on DeepSpeed's engine
                      with `--enable-zbh1-exact-semantics` (its `ZeroBubbleH1Pipeline`): each backward
                      split into the input gradient (BackwardOnlyPass) and the weight gradient
                      (WeightPass), stage s deferring the weight passes of its first s backwards
                      into the drain, where 1F1B idles; in upstream's order, with sends posted
                      (not waited for: a blocking send would hold the sender until its peer's
                      backward, which costs ZB-H1 much of its gain)
    interleaved       interleaved 1F1B (Narayanan et al. 2021): v model chunks per rank, flat stage
                      c * P + r on rank r (megatron-core's numbering); the compute order is the one
                      torch.distributed.pipelining's `ScheduleInterleaved1F1B` generates (the
                      tests compare them), sends are posted without waiting (the receive waits)

The order of computation of ZB-H1 equals torch's `ScheduleInterleavedZeroBubble` with one stage per
rank, and that of interleaved its `ScheduleInterleaved1F1B` (tests/unit/test_pipeline_schedules.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

# Instruction kinds: DeepSpeed's class names (deepspeed/runtime/pipe/schedule.py), and the two that
# Megatron-DeepSpeed's ZB-H1 adds (megatron/core/pipeline_parallel/deepspeed_zbh1_schedule.py).
LOAD = "LoadMicroBatch"
FORWARD = "ForwardPass"
BACKWARD = "BackwardPass"
BACKWARD_INPUT = "BackwardOnlyPass"
"""The input gradient of a backward; its weight gradients wait for a WeightPass."""
WEIGHT = "WeightPass"
"""The weight gradients of the oldest BackwardOnlyPass whose weights are still pending."""
SEND_ACTIVATION = "SendActivation"
RECV_ACTIVATION = "RecvActivation"
SEND_GRAD = "SendGrad"
RECV_GRAD = "RecvGrad"
REDUCE_TIED = "ReduceTiedGrads"
REDUCE_GRADS = "ReduceGrads"
OPTIMIZER = "OptimizerStep"
COMPUTE = (FORWARD, BACKWARD, BACKWARD_INPUT, WEIGHT)
BACKWARDS = (BACKWARD, BACKWARD_INPUT)
"""Instructions that end a micro-batch's use of its saved activations."""
SENDS = (SEND_ACTIVATION, SEND_GRAD)
RECEIVES = (RECV_ACTIVATION, RECV_GRAD)


@dataclass(frozen=True)
class Instruction:
    """One instruction of one rank; `buffer` is the pipe-buffer slot it uses (None for a weight pass
    and the step's end)."""

    kind: str
    buffer: int | None = None
    micro_batch: int | None = None
    """The micro-batch a load, forward or backward runs (and the one a send or receive carries)."""
    chunk: int = 0
    """The model chunk (virtual stage) it runs on: flat stage chunk * P + rank (0 without interleaving)."""


_instruction = functools.lru_cache(maxsize=1 << 17)(Instruction)
"""Instructions are immutable: a stream shares equal ones (building a frozen dataclass costs more than finding it)."""

Steps = tuple[tuple[Instruction, ...], ...]
"""Per clock step, the rank's instructions in order."""
STEP_END = (Instruction(REDUCE_TIED), Instruction(REDUCE_GRADS), Instruction(OPTIMIZER))


# ---- DeepSpeed's 1F1B (TrainSchedule) ------------------------------------------------------------


def one_f_one_b_buffers(num_micro_batches: int, num_stages: int, stage: int, virtual: int = 1) -> int:
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


def one_f_one_b(num_micro_batches: int, num_stages: int, stage: int, virtual: int = 1) -> Steps:
    """DeepSpeed's TrainSchedule: 2(M + P - 1) clock steps; each sends the previous step's result
    before receiving, loads on the first and last stage, then computes; the last ends the batch."""
    assert virtual == 1, virtual
    m, p = num_micro_batches, num_stages
    buffers = one_f_one_b_buffers(m, p, stage)
    total = 2 * (m + p - 1)
    valid = range(m).__contains__
    prev, out = -1, []
    for step in range(total):
        mb, forward = _1f1b_micro_batch(step, p, stage)
        cmds: list[Instruction] = []
        if forward:
            if valid(prev) and stage > 0:
                cmds.append(_instruction(SEND_GRAD, prev % buffers, prev))
            if valid(mb) and stage > 0:
                cmds.append(_instruction(RECV_ACTIVATION, mb % buffers, mb))
        else:
            if valid(mb) and stage < p - 1:
                cmds.append(_instruction(RECV_GRAD, mb % buffers, mb))
            if valid(prev) and stage < p - 1:
                cmds.append(_instruction(SEND_ACTIVATION, prev % buffers, prev))
        if stage in (0, p - 1) and forward and valid(mb):
            cmds.append(_instruction(LOAD, mb % buffers, mb))
        if valid(mb):
            cmds.append(_instruction(FORWARD if forward else BACKWARD, mb % buffers, mb))
        if step == total - 1:
            cmds += STEP_END
        prev = mb
        out.append(tuple(cmds))
    return tuple(out)


def one_f_one_b_last_path(
    forward: Sequence[float], backward: Sequence[float], weight: Sequence[float], m: int, send: float
) -> float:
    """A path of 1F1B's replay (`step_bounds.last_stage_path_bound`): the last stage runs all its passes before
    its last backward; on equal stages (M + P - 1)(F + B), the whole step."""
    p = len(forward)
    return sum(forward[:-1]) + m * (forward[-1] + backward[-1]) + sum(backward[:-1]) + 2 * (p - 1) * send


# ---- ZB-H1 ---------------------------------------------------------------------------------------


def zero_bubble_h1_buffers(num_micro_batches: int, num_stages: int, stage: int, virtual: int = 1) -> int:
    """Upstream's buffer of micro-batch j on stage s is j mod (P - s): the forwards s runs before
    its first backward; fewer when the step has fewer micro-batches."""
    return min(num_stages - stage, num_micro_batches)


Order = list[tuple[str, int, int]]
"""A rank's compute actions in order: (F, B, I or W; chunk; micro-batch), torch's letters."""


def zero_bubble_h1(num_micro_batches: int, num_stages: int, stage: int, virtual: int = 1) -> Steps:
    """ZB-H1 with exact semantics in Megatron-DeepSpeed's sections (`ZeroBubbleH1Pipeline`): P - s - 1
    forwards; s steps of a forward and an input-gradient backward whose weight passes wait; then a
    forward, a backward and the oldest pending weight pass per step; the drain's backwards, each with
    a weight pass; the weight passes still pending; the step's end. Each step receives before it
    computes what it received and sends right after computing, in upstream's order (receive the
    activation, load, forward, receive the gradient, send the activation, backward, send the
    gradient, weight pass). Stage 0 defers nothing and runs whole backwards.

    With M >= P - 1 this is the order of torch's `ScheduleInterleavedZeroBubble` with one stage per
    rank; with fewer micro-batches upstream runs the drain's weight passes at once where torch
    defers the first s of them (tests/unit/test_pipeline_schedules.py compares both)."""
    assert virtual == 1, virtual
    m, p, s = num_micro_batches, num_stages, stage
    first, last = s == 0, s == p - 1
    buffers = zero_bubble_h1_buffers(m, p, s)
    done = {"f": 0, "b": 0, "w": 0}

    def ins(kind: str, j: int) -> Instruction:
        return _instruction(kind, j % buffers, j)

    def forward() -> list[Instruction]:
        j = done["f"]
        done["f"] += 1
        cmds = [] if first else [ins(RECV_ACTIVATION, j)]
        return cmds + ([ins(LOAD, j)] if first or last else []) + [ins(FORWARD, j)]

    def weight() -> list[Instruction]:
        done["w"] += 1
        return [_instruction(WEIGHT, None, done["w"] - 1)]

    def backward(weight_now: bool) -> list[Instruction]:
        j = done["b"]
        done["b"] += 1
        if first:  # nothing to send before the weights: one whole backward
            done["w"] += 1
            return [ins(BACKWARD, j)]
        return [ins(BACKWARD_INPUT, j), ins(SEND_GRAD, j)] + (weight() if weight_now else [])

    def exchange() -> list[Instruction]:  # between a forward and the backward after it
        return [] if last else [ins(RECV_GRAD, done["b"]), ins(SEND_ACTIVATION, done["f"] - 1)]

    out: list[list[Instruction]] = []
    for _ in range(min(p - s - 1, m)):  # warm-up forwards
        out.append(forward() + ([] if last else [ins(SEND_ACTIVATION, done["f"] - 1)]))
    for _ in range(min(s, m - done["f"])):  # forward, backward; the weights wait
        out.append(forward() + exchange() + backward(weight_now=False))
    while done["f"] < m:  # forward, backward, the oldest weights
        out.append(forward() + exchange() + backward(weight_now=True))
    while done["b"] < m:  # the drain: backward and weights
        out.append(([] if last else [ins(RECV_GRAD, done["b"])]) + backward(weight_now=True))
    while done["w"] < m:  # the weight passes still pending fill the drain's bubble
        out.append(weight())
    out.append(list(STEP_END))
    return tuple(tuple(step) for step in out)


def zero_bubble_h1_last_path(
    forward: Sequence[float], backward: Sequence[float], weight: Sequence[float], m: int, send: float
) -> float:
    """A path of ZB-H1's replay (`step_bounds.last_stage_path_bound`): the last stage runs its M forwards and
    input-gradient passes and M - P of its weight passes before its last input-gradient pass (`zero_bubble_h1`'s
    order), and stage 0 runs whole backwards; on equal stages M(F + B) + (P - 1)(F + B - W) with B the
    input-gradient pass, the whole step."""
    p = len(forward)
    inputs = [b - w for b, w in zip(backward, weight)]
    last = m * (forward[-1] + inputs[-1]) + max(0, m - p) * weight[-1]
    return sum(forward[:-1]) + last + sum(inputs[1:-1]) + backward[0] + 2 * (p - 1) * send


# ---- interleaved 1F1B ----------------------------------------------------------------------------


def interleaved_rounds(num_micro_batches: int, num_stages: int) -> tuple[int, int]:
    """(rounds, micro-batches per round) of torch's interleaved schedules: max(1, M // P) rounds,
    which must divide M."""
    rounds = max(1, num_micro_batches // num_stages)
    return rounds, num_micro_batches // rounds


def interleaved_order(num_micro_batches: int, num_stages: int, rank: int, virtual: int) -> Order:
    """(F or B, chunk, micro-batch) in the order rank `rank` computes them: torch's
    `ScheduleInterleaved1F1B._calculate_single_rank_operations` without its idle slots. Warm-up:
    (v - 1) x (M per round) + 2 (P - 1 - r) forwards; then one forward and one backward per step;
    then the remaining backwards. Chunks advance every M-per-round forwards (depth first), the
    backwards run the chunks from the last."""
    m, p, v, r = num_micro_batches, num_stages, virtual, rank
    _, per_round = interleaved_rounds(m, p)
    ops = v * m
    warmup = min((v - 1) * per_round + 2 * (p - 1 - r), ops)
    next_mb = {"F": [0] * v, "B": [0] * v}

    def take(kind: str, chunk: int) -> tuple[str, int, int]:
        j = next_mb[kind][chunk]
        next_mb[kind][chunk] += 1
        return kind, chunk, j

    order = []
    for op in range(ops + warmup):  # warm-up + steady (F, B) + cool-down: 2 v M actions in all
        if op < ops:
            order.append(take("F", (op // per_round) % v))
        if op >= warmup:
            order.append(take("B", v - 1 - ((op - warmup) // per_round) % v))
    return order


def interleaved_buffers(num_micro_batches: int, num_stages: int, stage: int, virtual: int = 1) -> int:
    """One slot per (chunk, micro-batch): slot chunk * M + j (the engine frees each after use)."""
    return virtual * num_micro_batches


def place_interleaved(order: Order, num_micro_batches: int, num_stages: int, rank: int, virtual: int) -> Steps:
    """One step per forward or backward of an interleaved order: the receive it needs, a load on the
    first and the last flat stage, the pass, the send of its result (posted, not waited for)."""
    m, p, v = num_micro_batches, num_stages, virtual
    last_flat = v * p - 1
    out = []
    for kind, chunk, j in order:
        flat, buf = chunk * p + rank, chunk * m + j

        def ins(k: str) -> Instruction:
            return _instruction(k, buf, j, chunk)  # noqa: B023 - used at once

        if kind == "F":
            cmds = [] if flat == 0 else [ins(RECV_ACTIVATION)]
            cmds += [ins(LOAD)] if flat in (0, last_flat) else []
            cmds += [ins(FORWARD)] + ([] if flat == last_flat else [ins(SEND_ACTIVATION)])
        else:
            cmds = [] if flat == last_flat else [ins(RECV_GRAD)]
            cmds += [ins(BACKWARD)] + ([] if flat == 0 else [ins(SEND_GRAD)])
        out.append(tuple(cmds))
    out.append(STEP_END)
    return tuple(out)


def interleaved(num_micro_batches: int, num_stages: int, rank: int, virtual: int = 2) -> Steps:
    """Interleaved 1F1B: `interleaved_order` in `place_interleaved`'s steps."""
    order = interleaved_order(num_micro_batches, num_stages, rank, virtual)
    return place_interleaved(order, num_micro_batches, num_stages, rank, virtual)


def check_interleaved(num_micro_batches: int, num_stages: int, virtual: int) -> str | None:
    """Why interleaving cannot run (M, P, v), or None: v >= 2 chunks on P >= 2 ranks, and the rounds
    of torch's schedule must divide M."""
    if virtual < 2:
        return f"needs 2 or more virtual stages per rank, got {virtual}"
    if num_stages < 2:
        return "needs --pipeline-model-parallel-size 2 or more"
    rounds, _ = interleaved_rounds(num_micro_batches, num_stages)
    if num_micro_batches % rounds:
        return (
            f"needs the micro-batches per step ({num_micro_batches}) to be a multiple of max(1, M // P) = {rounds} "
            f"(torch's interleaved rounds); choose a global batch size that gives a multiple of "
            f"{num_stages} micro-batches"
        )
    return None
