"""The moments of one pipeline rank's training step, and its peak: the largest of them. Pure: no torch.

`memory_model.rank_memory_for` sums what the rank holds (`RankContents`); `rank_peak` prices what is alive at each
moment (`memory_model`'s docstring describes them): the first backward, every distinct later backward and weight
pass of the schedule's instruction stream (`pipeline_schedules.distinct_moments`), the optimizer step and, when
distilling, the end of a training forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_ds.estimate import distillation_costs, pipeline_schedules
from megatron_ds.estimate.memory_inputs import MemoryInputs, SpecMemory
from megatron_ds.estimate.model_states import PRECISION_BYTES
from megatron_ds.estimate.transients import (
    backward_transient,
    chunk_pipe_buffers,
    logits_counted_twice,
    pipe_buffers,
    refilled_slot_logits,
    step_temporaries,
    weight_pass_transient,
)
from megatron_ds.model import naming

Priced = tuple[float, str]
"""Bytes, and what the memory report names them."""
Chunk = tuple[list[SpecMemory], int, list[SpecMemory]]
"""One model chunk of a rank: (its pre specs, its transformer layers, its post specs)."""
FirstAt = tuple[tuple[int, ...], int, int]
"""The first backward as `pipeline_schedules.distinct_moments` reads it: (micro-batches in flight per chunk, weight
passes pending, the chunk whose backward it is)."""


@dataclass(frozen=True)
class RankStates:
    """The rank's model states in bytes (`host`: offloaded, off the device) and its parameter count."""

    num_params: int
    params: float
    """With a distillation teacher's frozen weights (`teacher`)."""
    grads: float
    optimizer: float
    host: float
    teacher: float


@dataclass(frozen=True)
class RankContents:
    """What one pipeline rank holds, as `memory_model.rank_memory_for` sums it; chunk c is its model chunk c."""

    inputs: MemoryInputs
    rank: int
    num_ranks: int
    chunks: list[Chunk]
    layer: SpecMemory
    """The transformer layer the rank holds copies of."""
    held: list[SpecMemory]
    """Each distinct spec of the rank once."""
    states: RankStates
    no_decay_params: int
    per_micro_batch: list[float]
    """Per chunk: the activations one micro-batch saves."""
    stores: list[float]
    """Per chunk: what one micro-batch keeps for its weight passes (ZB-H1)."""
    recompute: int
    """The largest chunk of layers a backward recomputes."""

    @property
    def last(self) -> bool:
        """Whether the rank holds the head (the post specs)."""
        return any(post for _, _, post in self.chunks)

    @property
    def freed(self) -> float:
        """A first-stage micro-batch's activations other than the token ids the embedding saved: freed before the
        word embedding's gradient is computed (see `transients.backward_transient`)."""
        pre = self.chunks[0][0]
        return self.per_micro_batch[0] - sum(sp.activations for sp in pre if sp.name == naming.WORD_EMBEDDING)

    @property
    def fresh_grads(self) -> float:
        """The step's gradients, which exist from the first backward on: DeepSpeed sets every `.grad` to None after
        the optimizer step (engine.zero_grad; zero_grad(set_to_none=True) of its ZeRO and bf16 optimizers), so only
        the rest of `grads` (flat fp32 buffers, partitions) is always held."""
        s, inputs = self.states, self.inputs
        return min(s.grads, s.num_params * PRECISION_BYTES[inputs.precision]) if inputs.zero_stage <= 1 else 0.0

    @property
    def always(self) -> float:
        """What every moment but the optimizer step holds of the model states: all but the step's gradients."""
        s = self.states
        return s.params + s.optimizer + s.grads - self.fresh_grads


@dataclass(frozen=True)
class Peak:
    """The rank's peak (before ZeRO-3's gathered parameters) and the first backward's terms reported apart."""

    size: float
    """Bytes."""
    source: str
    """Which moment it is, and what it holds."""
    in_flight: int
    activations: float
    pipe_buffers: float
    backward_transient: float
    """A later backward's largest short-lived buffer on its own (`StageMemory.backward_transient`)."""


def rank_peak(r: RankContents) -> Peak:
    """The largest of the rank's moments (the first of equals), which is its peak."""
    inputs = r.inputs
    first_at, later = pipeline_schedules.distinct_moments(
        inputs.pipeline_schedule, inputs.num_micro_batches, r.num_ranks, r.rank
    )
    if len(r.chunks) == 1:
        buffers, persistent = pipe_buffers(inputs, r.rank, r.num_ranks)
    else:
        buffers, persistent = chunk_pipe_buffers(inputs, r.rank, r.num_ranks, first_at[0])
    first, saved, first_buffers = _first_backward(r, first_at, buffers)
    s = r.states
    step, step_source = step_temporaries(inputs, r.held, s.num_params, r.no_decay_params, r.num_ranks)
    moments = [
        first,
        _largest_later(r, later or [_only_backward(first_at, len(r.chunks))], buffers),
        (s.params + s.grads + s.optimizer + persistent + step, f"optimizer step: {step_source}"),
    ]
    if inputs.teacher is not None:
        moments.append(_teacher_forward(r, buffers))
    peak, source = max(moments, key=lambda m: m[0])
    accumulating = inputs.num_micro_batches > 1
    later_bwd = backward_transient(inputs, r.layer, r.recompute, r.held, r.last, r.freed, accumulating=accumulating)
    return Peak(peak, source, sum(first_at[0]), saved, first_buffers, later_bwd[0])


def _first_backward(r: RankContents, first_at: FirstAt, buffers: float) -> tuple[Priced, float, float]:
    """(the first backward, the activations and pipe buffers alive at it): no gradient of the step exists yet."""
    flight = sum(first_at[0])
    saved = sum(n * a for n, a in zip(first_at[0], r.per_micro_batch)) + first_at[1] * r.stores[0]
    bwd = backward_transient(r.inputs, r.layer, r.recompute, r.held, r.last, r.freed, accumulating=False)
    bwd = _or_refill(bwd, refilled_slot_logits(r.inputs, r.rank, r.num_ranks, flight, first_at[1]))
    held_buffers = buffers - logits_counted_twice(r.inputs, r.rank, r.num_ranks, flight, first_at[1])
    label = f"first backward, {flight} micro-batch(es) in flight, no gradient yet" + (f"; {bwd[1]}" if bwd[0] else "")
    return (r.always + saved + held_buffers + bwd[0], label), saved, held_buffers


def _largest_later(r: RankContents, moments: Sequence[pipeline_schedules.Moment], buffers: float) -> Priced:
    """The largest of the later moments (the first of equals), each with the activations in flight on every chunk,
    what the weight passes still keep (ZB-H1's stored inputs and output gradients) and the gradients made so far."""
    shares, always, fresh = _gradient_shares(r, moments), r.always, r.fresh_grads
    options = []
    transients: dict[tuple[str, bool], Priced] = {}  # moments share a few kinds: price each once
    for mo, held_share in zip(moments, shares):
        saved = sum(n * a for n, a in zip(mo.flight, r.per_micro_batch)) + mo.pending * r.stores[0]
        key = (mo.kind, mo.accumulating)
        if key not in transients:
            transients[key] = _moment_transient(r, mo)
        extra_what, in_flight = transients[key], sum(mo.flight)
        if mo.kind != pipeline_schedules.WEIGHT:
            extra_what = _or_refill(
                extra_what, refilled_slot_logits(r.inputs, r.rank, r.num_ranks, in_flight, mo.pending)
            )
        held_buffers = buffers - logits_counted_twice(r.inputs, r.rank, r.num_ranks, in_flight, mo.pending)
        options.append((always + fresh * held_share + saved + held_buffers + extra_what[0], mo, held_share, extra_what))
    total, mo, held_share, (extra, what) = max(options, key=lambda o: o[0])  # the first of equals
    return total, _moment_label(mo, held_share, what if extra else "")


def _gradient_shares(r: RankContents, moments: Sequence[pipeline_schedules.Moment]) -> list[float]:
    """Per moment, the share of the rank's parameters whose gradients exist: per chunk, those a backward makes once
    one ran (interleaving runs the last chunk's backwards first) and, where a split backward leaves them to the
    weight pass (ZB-H1), the linears' weights once a weight pass ran."""
    layer = r.layer
    weights = [
        sum(sp.deferrable_params for sp in pre + post) + k * layer.deferrable_params for pre, k, post in r.chunks
    ]
    weights = [w if r.inputs.pipeline_schedule.splits_backward else 0 for w in weights]
    whole = [sum(sp.num_params for sp in pre + post) + k * layer.num_params for pre, k, post in r.chunks]
    return [
        (sum(whole[c] - weights[c] for c in mo.backward_grads) + sum(weights[c] for c in mo.weight_grads))
        / r.states.num_params
        for mo in moments
    ]


def _moment_transient(r: RankContents, mo: pipeline_schedules.Moment) -> Priced:
    """A later moment's largest short-lived buffer: a weight pass's, or a (whole or input-gradient) backward's."""
    if mo.kind == pipeline_schedules.WEIGHT:
        return weight_pass_transient(r.inputs, r.held, mo.accumulating)
    defers = mo.kind == pipeline_schedules.BACKWARD_INPUT
    return backward_transient(r.inputs, r.layer, r.recompute, r.held, r.last, r.freed, mo.accumulating, defers)


def _teacher_forward(r: RankContents, buffers: float) -> Priced:
    """After the student's forward: its activations, the teacher's forward and the kd loss."""
    inputs, w = r.inputs, PRECISION_BYTES[r.inputs.precision]
    kd, kd_what = distillation_costs.forward_transient(
        inputs.teacher, inputs.micro_batch_size, inputs.tensor_parallel_size, w, inputs.expert_parallel_size
    )
    grads = r.fresh_grads if inputs.num_micro_batches > 1 else 0.0  # the earlier micro-batches' gradients
    return (
        r.always + grads + r.per_micro_batch[0] + buffers + kd,
        f"a training forward's end, 1 micro-batch: {kd_what}",
    )


def _or_refill(transient: Priced, refill: float) -> Priced:
    """A backward moment's transient, or the forward just before it when that holds more (the last stage under
    the vocabulary-parallel loss: `transients.refilled_slot_logits`)."""
    if refill > transient[0]:
        return (
            refill,
            "the forward before it: its logits made while the pipe-buffer slot it refills holds an earlier one",
        )
    return transient


def _moment_label(mo: pipeline_schedules.Moment, held_share: float, transient: str) -> str:
    """What a later moment holds, as the memory report names its peak."""
    if mo.kind == pipeline_schedules.WEIGHT:
        label = f"a weight pass, {sum(mo.flight)} micro-batch(es) in flight, {mo.pending} weight pass(es)' store"
    else:
        label = f"a later backward, {sum(mo.flight)} micro-batch(es) in flight"
        label += f", {mo.pending} weight pass(es)' store" if mo.pending else ""
    label += ", gradients held" + (f" (of {held_share:.0%} of the parameters)" if held_share < 1 else "")
    return label + (f"; {transient}" if transient else "")


def _only_backward(first_at: FirstAt, num_chunks: int) -> pipeline_schedules.Moment:
    """One micro-batch (M = 1, no later backward): the moment after its backward began, as if a later one."""
    flight = tuple(n - (c == first_at[2]) for c, n in enumerate(first_at[0]))
    every = tuple(range(num_chunks))
    return pipeline_schedules.Moment(pipeline_schedules.BACKWARD, flight, first_at[1], every, every, False)
