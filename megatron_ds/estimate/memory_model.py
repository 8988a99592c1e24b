"""Analytic per-stage memory of our GPT on DeepSpeed's pipeline engine, from each spec's (`spec_memory.py`). Pure:
no torch.

The peak on one GPU of stage s is the largest of these moments of a training step (`rank_memory_for` sums what
the rank holds; `memory_moments.py` prices each moment and picks the largest):

    first backward  = params + optimizer + persistent grads + in_flight(s) x activations of one
                      micro-batch + pipe buffers + a backward transient (no gradient of this step yet)
    later backward  = the same with the step's gradients and, unless a forward follows, one
                      micro-batch fewer in flight
                      (on the last stage at T > 1, where the vocabulary-parallel loss works in the fp32
                      logits, each micro-batch's logits are counted once: as its saved softmax, its stored
                      gradient or a pipe buffer's; the forward before a backward, whose refilled pipe-buffer
                      slot still holds earlier logits, stands in for the backward's transient when larger)
    weight pass     = (schedules that split backwards, ZB-H1) the activations still in flight, the
                      stores of the pending weight passes (its own included: it frees them at its end),
                      the linears' weight gradients, which exist only from the step's first weight pass
                      on (a split backward makes only those of norms, biases and embeddings), and, from
                      the second pass on, one weight gradient before accumulation
    optimizer step  = params + grads + optimizer + pipe buffers that persist + the step's largest
                      temporary (the gradient all-reduce's flat copy or ZeRO-1's reduce buckets, AdamW's
                      sqrt/div temporaries)

(per spec: `spec_memory.py`; model states: `model_states.py`; activations: `activation_memory.py` and
`attention_activations.py`).
in_flight(s) is read off the schedule's instruction stream (`pipeline_schedules.activations_in_flight`): under DeepSpeed's
1F1B TrainSchedule stage s runs P - s forwards before its first backward, so min(P - s, M)
micro-batches' activations are alive (M micro-batches per step); the engine cycles through the
schedule's pipe buffers (`transients.pipe_buffers` says which of them hold what).

Everything returned is an estimate; nothing here is measured. The terms beyond the classic sum
(the moments, the last stage's kept logits, the step's temporaries, the word embedding's
gradient after its micro-batch's activations are freed) were found by comparing with the measured
peaks of `benchmarks/stage_memory.py` and are each traced to the DeepSpeed or torch code that
allocates them, cited where they are computed. The weight pass moment was found with the allocation
trace of `benchmarks/schedules.py target` (48 layers, P = 5, M = 4): every ZB-H1 rank after the first
peaks in a weight pass, the last one in its second (3 stores, every gradient and the head's weight
gradient before accumulation), where the model had put it at a later backward with every gradient held,
5.4% over the measured peak of the last rank. The last stage at T > 1 was found with the allocation trace of
a P = 2, T = 2 run (8 layers, h 256, vocabulary 8192, M = 4, sequence parallel): 1F1B peaks in a forward,
ZB-H1 in a weight pass; counting the logits apart from the softmax and stores that are the same tensor, with
torch's two loss gradients beside them, had put it 12% (1F1B) and 7.6% (ZB-H1) over; 0.9% and 0.5% under now.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megatron_ds.estimate import activation_memory as act
from megatron_ds.estimate import distillation_costs
from megatron_ds.estimate.memory_inputs import MemoryInputs, SpecMemory, StageMemory
from megatron_ds.estimate.memory_moments import Chunk, RankContents, RankStates, rank_peak
from megatron_ds.estimate.model_states import PRECISION_BYTES
from megatron_ds.estimate.spec_memory import spec_memory
from megatron_ds.estimate.stage_contents import checkpointed_chunks, held_total, stage_parts
from megatron_ds.estimate.transients import gathered, weight_store_bytes


@functools.lru_cache(maxsize=256)
def _spec_parts(inputs: MemoryInputs) -> tuple[tuple[SpecMemory, ...], tuple[SpecMemory, ...], SpecMemory]:
    """(the pre specs, the post specs, one transformer layer): what a stage can hold. A mixture-of-experts model's
    layers differ (those with experts, and their counts), and so do layers of different sliding windows
    (`--window-attn-skip-freq`): its layer is then the mean of every layer (`_mean_layer`), exact for a stage that
    holds them all; a stage of a layout holds the mean of its own (`_held_layer`)."""
    pre, post, layer = stage_parts(spec_memory(inputs, one_layer=True))
    if _layers_differ(inputs):
        layer = _mean_layer(list(_body_layers(inputs)))
    return pre, post, layer


def _layers_differ(inputs: MemoryInputs) -> bool:
    """Whether the transformer layers' memory differs from layer to layer (experts, or per-layer windows)."""
    return inputs.model.is_moe or len(set(inputs.model.layer_windows)) > 1


@functools.lru_cache(maxsize=256)
def _body_layers(inputs: MemoryInputs) -> tuple[SpecMemory, ...]:
    """Every transformer layer's spec, in order (a mixture-of-experts model's differ)."""
    return tuple(sp for sp in spec_memory(inputs) if sp.group == "body")


def _held_layer(
    inputs: MemoryInputs, chunk_layers: tuple[int, ...], first_layers: tuple[int, ...] | None
) -> SpecMemory:
    """The layer a rank holds `sum(chunk_layers)` copies of: for a mixture-of-experts model whose chunks start at
    `first_layers` (their global layer indices), the mean of the layers it holds, so that its sums count the experts
    of its own layers (P > 1), or the windows of its own layers; otherwise `_spec_parts`' layer."""
    if not _layers_differ(inputs) or first_layers is None or not sum(chunk_layers):
        return _spec_parts(inputs)[2]
    body = _body_layers(inputs)
    held = [sp for first, k in zip(first_layers, chunk_layers, strict=True) for sp in body[first : first + k]]
    return _mean_layer(held)


def first_layers_of(layout: Any, rank: int) -> tuple[int, ...]:
    """The global index of the first transformer layer of each of `rank`'s stages in `layout`."""
    starts = [sum(layout.layers_per_stage[:s]) for s in range(len(layout.layers_per_stage))]
    return tuple(starts[s] for s in layout.rank_stages(rank))


def _mean_layer(layers: list[SpecMemory]) -> SpecMemory:
    """One spec whose sums over len(layers) copies are those of `layers` (largest tensors: the largest of them;
    the saved-activation terms: the layer that saves the most, what one layer's recompute allocates)."""
    n = len(layers)

    def mean(attr: str) -> float:
        return sum(getattr(sp, attr) for sp in layers) / n

    most = max(layers, key=lambda sp: sp.activations)
    return dataclasses.replace(
        layers[0],
        **{a: mean(a) for a in ("num_params", "params", "grads", "optimizer", "host", "checkpointed_activations")},
        **{a: mean(a) for a in ("no_decay_params", "deferrable_params", "activations")},
        **{
            a: max(getattr(sp, a) for sp in layers)
            for a in ("largest_param", "largest_deferrable", "largest_undeferred")
        },
        activation_terms=dict(most.activation_terms),
    )


def stage_memory(inputs: MemoryInputs, layout) -> list[StageMemory]:
    """Per-stage predicted memory for a `megatron_ds.pipeline.layout.Layout`; with virtual stages,
    per rank (its model chunks together)."""
    p = layout.num_ranks
    return [
        rank_memory_for(
            inputs, r, p, tuple(layout.layers_per_stage[s] for s in layout.rank_stages(r)), first_layers_of(layout, r)
        )
        for r in range(p)
    ]


def stage_memory_for(inputs: MemoryInputs, stage: int, num_stages: int, num_layers: int) -> StageMemory:
    """Memory of stage `stage` of `num_stages` holding `num_layers` transformer layers
    (plus the pre group on stage 0 and the post group on the last stage)."""
    return rank_memory_for(inputs, stage, num_stages, (num_layers,))


def _chunks(inputs: MemoryInputs, rank: int, num_ranks: int, chunk_layers: tuple[int, ...]) -> list[Chunk]:
    """Per model chunk: (pre specs, layers, post specs); chunk c is flat stage c x P + rank."""
    all_pre, all_post, _ = _spec_parts(inputs)
    last = len(chunk_layers) * num_ranks - 1
    out = []
    for c, k in enumerate(chunk_layers):
        flat = c * num_ranks + rank
        pre = list(all_pre) if flat == 0 else []
        post = list(all_post) if flat == last else []
        if flat == 0 == last:  # one stage: the tied head is the embedding module itself, held once
            post = [sp for sp in post if not sp.tied]
        out.append((pre, k, post))
    return out


def rank_memory_for(
    inputs: MemoryInputs,
    rank: int,
    num_ranks: int,
    chunk_layers: tuple[int, ...],
    first_layers: tuple[int, ...] | None = None,
) -> StageMemory:
    """Memory of pipeline rank `rank` of `num_ranks` holding `chunk_layers[c]` transformer layers in
    model chunk c (one chunk without virtual stages), chunk c's first being layer `first_layers[c]` when given (a
    mixture-of-experts model: the experts of those layers are counted; without it, its layers' mean)."""
    chunks = _chunks(inputs, rank, num_ranks, chunk_layers)
    layer = _held_layer(inputs, chunk_layers, first_layers)
    ends = [sp for pre, _, post in chunks for sp in pre + post]
    num_layers = sum(chunk_layers)
    held = ends + [layer] * bool(num_layers)  # each distinct spec once; totals count the layer num_layers times
    states = _model_states(inputs, ends, layer, num_layers, held)
    per_mb, store, recompute = _chunk_activations(inputs, chunks, layer)
    no_decay = held_total(ends, layer, num_layers, "no_decay_params")
    contents = RankContents(inputs, rank, num_ranks, chunks, layer, held, states, no_decay, per_mb, store, recompute)
    peak = rank_peak(contents)
    total = peak.size + gathered(inputs, ends, layer, num_layers)
    return StageMemory(
        stage=rank,
        num_layers=num_layers,
        num_params=states.num_params,
        params=states.params,
        grads=states.grads,
        optimizer=states.optimizer,
        host=states.host,
        activation_per_micro_batch=max(per_mb),
        in_flight=peak.in_flight,
        activations=peak.activations,
        pipe_buffers=peak.pipe_buffers,
        transient=total - (states.params + states.grads + states.optimizer + peak.activations + peak.pipe_buffers),
        transient_source=peak.source,
        backward_transient=peak.backward_transient,
        weight_store_per_micro_batch=store[0],
        teacher=states.teacher,
    )


def _model_states(
    inputs: MemoryInputs, ends: list[SpecMemory], layer: SpecMemory, num_layers: int, held: list[SpecMemory]
) -> RankStates:
    """The rank's parameters, gradients, optimizer and host states, with offload's staging buffers and a distillation
    teacher's frozen weights: what it holds whatever the moment."""

    def total(attr: str) -> int:
        return held_total(ends, layer, num_layers, attr)

    params, grads, optimizer, host = (total(a) for a in ("params", "grads", "optimizer", "host"))
    w = PRECISION_BYTES[inputs.precision]
    if inputs.offload_optimizer != "none" and inputs.zero_stage <= 2:
        # stage_1_and_2.py's two staging buffers of the stage's largest parameter: one pinned on the host
        # (temp_grad_buffer_for_cpu_offload), one on the device (temp_grad_buffer_for_gpu_offload)
        staging = max(sp.largest_param for sp in held) * w
        optimizer += staging
        host += staging
    teacher = (
        distillation_costs.teacher_weight_bytes(
            inputs.teacher, inputs.tensor_parallel_size, w, inputs.expert_parallel_size
        )
        if inputs.teacher
        else 0.0
    )
    # the teacher is frozen, outside the engine: no gradient, optimizer state, partition or offload
    return RankStates(total("num_params"), params + teacher, grads, optimizer, host, teacher)


def _chunk_activations(
    inputs: MemoryInputs, chunks: list[Chunk], layer: SpecMemory
) -> tuple[list[float], list[float], int]:
    """(per model chunk the activations one micro-batch saves, per chunk what it keeps for its weight passes, the
    largest chunk of layers a backward recomputes): what the moments multiply by the micro-batches in flight."""
    per_mb, store, recompute = [], [], 0
    for pre, k, post in chunks:
        full, chunk = _recomputed(inputs, len(pre), k, len(post))
        recompute = max(recompute, chunk)
        per_mb.append(
            sum(sp.activations for sp in pre + post)
            + full * layer.activations
            + (k - full) * layer.checkpointed_activations
            + _checkpoint_states(inputs, bool(pre), k, full)
        )
        store.append(weight_store_bytes(inputs, k, holds_head=bool(post)))
    return per_mb, store, recompute


def _checkpoint_states(inputs: MemoryInputs, first: bool, num_layers: int, full_layers: int) -> float:
    """The generator states DeepSpeed's checkpointing keeps per call and micro-batch (one call per recomputed
    chunk, or per layer under selective recomputation), for the tracker's streams of this stage: each layer's
    two dropout streams, the embedding's, megatron-core's model-parallel one at T > 1 (those that draw)."""
    chunks = -(-(num_layers - full_layers) // max(inputs.checkpoint_num_layers, 1))
    calls = num_layers if inputs.selective_recompute else chunks if inputs.checkpoint_activations else 0
    if not calls:
        return 0.0
    reg = inputs.regularization
    streams = num_layers * ((reg.hidden_dropout > 0) + (reg.attention_dropout > 0))
    streams += (first and reg.hidden_dropout > 0) + (inputs.tensor_parallel_size > 1)
    return calls * act.checkpoint_rng_bytes(inputs.kernels, streams)


def _recomputed(inputs: MemoryInputs, num_pre: int, num_layers: int, num_post: int) -> tuple[int, int]:
    """(transformer layers that keep full activations, largest recomputed chunk in layers): DeepSpeed's
    chunking (`stage_contents.checkpointed_chunks`)."""
    interval = inputs.checkpoint_num_layers if inputs.checkpoint_activations else 0
    recomputed, largest = checkpointed_chunks(num_pre, num_layers, num_post, interval)
    return num_layers - recomputed, largest
