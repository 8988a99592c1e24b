"""The short-lived and pipeline-schedule terms of the memory model (`memory_model`): micro-batches
in flight and DeepSpeed's pipe buffers under the run's schedule, a backward's largest transient, the optimizer
step's temporaries (gradient all-reduce copy, ZeRO-1 buckets, optimizer kernel temporaries) and
ZeRO-3's gathered working set. Each traced to the DeepSpeed or torch code that allocates it. Pure:
no torch.
"""

from __future__ import annotations

import functools

from megatron_ds.config import ModelConfig
from megatron_ds.estimate import activation_memory as act
from megatron_ds.estimate import moe_costs, pipeline_schedules
from megatron_ds.estimate.activation_kernels import DOCUMENT_ID_BYTES, LOSS_MASK_BYTES, TOKEN_ID_BYTES
from megatron_ds.estimate.attention_activations import (
    attention_backward_bytes,
    mlp_half_bytes,
    recomputed_attention_bytes,
)
from megatron_ds.estimate.memory_inputs import MemoryInputs, SpecMemory
from megatron_ds.estimate.model_states import (
    MASTER_BYTES,
    OPTIMIZER_KERNEL,
    OPTIMIZER_TEMPORARIES,
    PRECISION_BYTES,
    zero_bucket_elements,
)
from megatron_ds.model import naming, shapes


def in_flight(inputs: MemoryInputs, stage: int, num_stages: int) -> tuple[int, int]:
    """(at the first backward, at the fullest later backward): micro-batches whose activations stage
    `stage` holds under the run's schedule (1F1B: min(P - s, M), and as many again after the first
    backward when a forward follows it, M > P - s, else one fewer)."""
    schedule = inputs.pipeline_schedule
    return pipeline_schedules.activations_in_flight(schedule, inputs.num_micro_batches, num_stages, stage)


def weight_store_bytes(inputs: MemoryInputs, num_layers: int, holds_head: bool) -> float:
    """What one micro-batch keeps between its input-gradient backward and its weight pass (ZB-H1,
    `model/weight_grad.py`): every linear layer's input and output gradient, in the activation
    dtype, per tensor rank (column-parallel QKV and fc1 keep a full input and 1/T of the output
    gradient, row-parallel proj and fc2 1/T of the input and the full output gradient), and the LM
    head's input and its 1/T of the logits' gradient. Zero for schedules that do not split backwards."""
    if not inputs.pipeline_schedule.splits_backward:
        return 0.0
    m, t = inputs.model, inputs.tensor_parallel_size
    tokens = m.seq_length * inputs.micro_batch_size
    column = ("qkv", "fc1")
    per_layer = sum(
        (i + o / t) if name in column else (i / t + o) for name, (o, i) in shapes.layer_linear_shapes(m).items()
    )
    head = m.hidden_size + m.vocab_size / t if holds_head else 0.0
    return PRECISION_BYTES[inputs.precision] * tokens * (num_layers * per_layer + head)


def backward_transient(
    inputs: MemoryInputs,
    layer: SpecMemory,
    chunk: int,
    held: list[SpecMemory],
    last: bool,
    freed_before_embedding: float,
    accumulating: bool,
    defers_weights: bool = False,
) -> tuple[float, str]:
    """The largest short-lived buffer of one backward: recomputation, loss gradients, or (when
    `accumulating`: the gradients it makes already exist) a weight gradient created before it is
    added into the accumulated one; a backward that `defers_weights` (ZB-H1's input gradient) makes only the
    gradients of what is not a linear's weight (norms, biases, embeddings; `weight_pass_transient`
    has the others).

    The word embedding's gradient is the last one a first-stage backward computes: every other
    activation that micro-batch saved on the stage (`freed_before_embedding` bytes) has been
    released by then, so it adds only what it exceeds them by (measured on CPU by
    `benchmarks/stage_memory.py`: the stage-0 peak is at `embedding_dense_backward`).
    `held`: the stage's distinct specs (a transformer layer once, however many the stage holds).
    """
    options = [(0.0, "none")]
    m, b, k, split = inputs.model, inputs.micro_batch_size, inputs.kernels, inputs.split
    has_layers = any(sp.group == "body" for sp in held)
    # A layer's backward reaches its core attention with its MLP half freed; on the math path the gradient
    # of the attention probabilities is then allocated beside what the attention saved.
    # The layers' sliding windows: the largest of their figures.
    windows = set(m.layer_windows)
    attention = max(attention_backward_bytes(m, b, k, split, w) for w in windows)
    attention -= mlp_half_bytes(layer.activation_terms, m.activation)
    if chunk:
        options.append(
            (chunk * layer.activations + max(0.0, attention), f"recomputing {chunk} layer(s) of one micro-batch")
        )
    if inputs.selective_recompute and has_layers:
        reg = inputs.regularization
        again = max(recomputed_attention_bytes(m, b, k, split, regularization=reg, window=w) for w in windows)
        options.append((again + attention, "recomputing one layer's core attention of one micro-batch"))
    elif has_layers and not chunk:
        options.append((attention, "the core attention's backward (its probabilities' gradient)"))
    if m.is_moe and inputs.expert_parallel_size > 1:  # DeepSpeed's _AllToAll: input and output both alive
        most = max(m.experts_per_layer)
        buffer = moe_costs.all_to_all_bytes(m, b, most, PRECISION_BYTES[inputs.precision])
        options.append((2 * buffer, "an all-to-all's input and output of one mixture-of-experts layer's backward"))
    if last:
        t = inputs.tensor_parallel_size
        loss = act.loss_backward_transient(m, b, t, inputs.ulysses_size, PRECISION_BYTES[inputs.precision])
        what = "fp32 loss gradients d(log-probs), d(logits) of one micro-batch"
        if act.loss_in_logits(t):
            what = "the 16-bit logits' gradient of one micro-batch (the vocabulary-parallel loss's own is in place)"
        options.append((loss, what))
    if accumulating:
        w = PRECISION_BYTES[inputs.precision]
        for sp in held:
            size = (sp.largest_undeferred if defers_weights else sp.largest_param) * w
            if sp.name == naming.WORD_EMBEDDING:
                options.append(
                    (
                        size - freed_before_embedding,
                        "the word embedding's weight gradient before accumulation (after the "
                        "micro-batch's other activations are freed)",
                    )
                )
            else:
                options.append((size, "one weight gradient before accumulation"))
    return max(options, key=lambda o: o[0])


def weight_pass_transient(inputs: MemoryInputs, held: list[SpecMemory], accumulating: bool) -> tuple[float, str]:
    """The largest short-lived buffer of one weight pass (`WeightGradStore.run_oldest`): when its
    gradients already exist (`accumulating`), each linear's weight gradient is made whole before it is
    added into `.grad` and freed, one at a time; the first pass of a step keeps each one as the `.grad`."""
    largest = max((sp.largest_deferrable for sp in held), default=0)
    if not accumulating or not largest:
        return 0.0, "none"
    return largest * PRECISION_BYTES[inputs.precision], "one weight gradient before accumulation"


ALLREDUCE_BUCKET_ELEMENTS = 500_000_000
"""`MEMORY_OPT_ALLREDUCE_SIZE` in deepspeed/runtime/engine.py: the pipeline engine's gradient
all-reduce bucket (elements)."""


@functools.lru_cache(maxsize=256)  # the memory model asks for every rank of every candidate
def zero_bucket_elements_for(model: ModelConfig, num_stages: int, data_parallel_size: int, t: int = 1) -> int:
    """ZeRO-1's `reduce_bucket_size` our DeepSpeed JSON sets for this model (`model_states.zero_bucket_elements`)."""
    params = sum(sp.num_params for sp in shapes.gpt_spec_params(model, t))
    return zero_bucket_elements(params, num_stages, data_parallel_size)


def step_temporaries(
    inputs: MemoryInputs, held: list[SpecMemory], num_params: int, no_decay: int, num_stages: int
) -> tuple[float, str]:
    """The largest buffer alive between the last backward and the end of the optimizer step, for a stage
    holding the distinct specs `held`, `num_params` parameters and `no_decay` of them without weight decay.

    * Without ZeRO, the pipeline engine all-reduces gradients over data parallelism (also when
      that group has one rank) through `buffered_allreduce_fallback`, which flattens them into
      buckets of up to `ALLREDUCE_BUCKET_ELEMENTS` (a copy; fp32 gradients, the bf16 optimizer's
      fp32 ones, or fp16).
    * With ZeRO-1, `reduce_gradients(pipeline_parallel=True)` holds two buffers of
      `reduce_bucket_size` elements in the parameters' dtype while it reduces, with the step's
      gradients and their flat partition (`model_states.zero_bucket_elements` says why two; the
      generated JSON sets the size).
    * The optimizer's own temporaries follow `model_states.OPTIMIZER_KERNEL` for `inputs.device`
      (none for the fused kernel; fp32 copies of the tensor being stepped otherwise). Without ZeRO
      in fp32 the tensors are the parameters; otherwise DeepSpeed's optimizer wrapper (ZeRO,
      BF16_Optimizer, FP16_Optimizer) steps one flat fp32 tensor per parameter group (its
      partition under ZeRO), so the largest group's partition counts. Offloaded optimizers step on
      the host.
    """
    options = [(0.0, "no temporary")]
    if inputs.zero_stage == 0:
        width = 2 if inputs.precision == "fp16" else MASTER_BYTES if inputs.precision == "bf16" else 4
        options.append(
            (
                width * min(num_params, ALLREDUCE_BUCKET_ELEMENTS),
                "the flattened copy of the gradients in DeepSpeed's gradient all-reduce",
            )
        )
    if inputs.zero_stage == 1:
        bucket = zero_bucket_elements_for(
            inputs.model, num_stages, inputs.data_parallel_size, inputs.tensor_parallel_size
        )
        options.append(
            (2 * bucket * PRECISION_BYTES[inputs.precision], f"ZeRO-1's two reduce buckets of {bucket} elements")
        )
    kernel = OPTIMIZER_KERNEL[inputs.device]
    copies = OPTIMIZER_TEMPORARIES[(kernel, inputs.optimizer)]
    if inputs.offload_optimizer == "none" and copies:
        if inputs.precision == "fp32" and inputs.zero_stage == 0:
            big = max((sp.largest_param for sp in held), default=0)
            options.append((copies * MASTER_BYTES * big, f"{copies} fp32 temporaries of the largest tensor"))
        else:
            group = max(num_params - no_decay, no_decay) / inputs.data_parallel_size
            options.append((copies * MASTER_BYTES * group, f"{copies} fp32 temporaries of the largest flat group"))
    return max(options, key=lambda o: o[0])


def gathered(inputs: MemoryInputs, ends: list[SpecMemory], layer: SpecMemory, num_layers: int) -> float:
    """ZeRO-3's gathered working set: the largest module's full parameters and gradients (the estimator's
    4 x largest layer), and the parameters it prefetches ahead of use (up to `stage3_prefetch_bucket_size`
    elements, capped by the stage's parameters)."""
    if not inputs.factors.gathered:
        return 0.0
    held = ends + ([layer] if num_layers else [])
    stage_params = sum(sp.num_params for sp in ends) + num_layers * layer.num_params
    prefetch = min(inputs.zero3_prefetch_elements, stage_params) * PRECISION_BYTES[inputs.precision]
    return inputs.factors.gathered * max((sp.largest_param for sp in held), default=0) + prefetch


def _document_ids(inputs: MemoryInputs, tokens: int) -> float:
    """Packed documents' ids beside `tokens` tokens (`model/documents.py`); 0 without them."""
    return float(tokens * DOCUMENT_ID_BYTES) if inputs.document_ids else 0.0


def chunk_pipe_buffers(inputs: MemoryInputs, rank: int, num_ranks: int, flight: tuple[int, ...]) -> tuple[float, float]:
    """`pipe_buffers` for v model chunks per rank (`training/interleaved.py`), with `flight[c]`
    micro-batches in flight on chunk c: each buffer is freed after its last use, so every chunk holds
    its in-flight micro-batches' received inputs (after flat stage 0), outputs (before the last; the
    last flat stage's are the fp32 logits), token ids (flat stage 0) and labels (the last); the rank
    keeps one persistent receive buffer for activations and one for gradients (DeepSpeed's)."""
    m, v = inputs.model, len(flight)
    tokens = m.seq_length * inputs.micro_batch_size
    hidden = m.seq_length * inputs.micro_batch_size * m.hidden_size * PRECISION_BYTES[inputs.precision]
    hidden += _document_ids(inputs, tokens)
    last = v * num_ranks - 1
    total, persistent = 2 * hidden, 2 * hidden
    for c, n in enumerate(flight):
        flat = c * num_ranks + rank
        total += n * hidden if flat > 0 else n * (tokens * TOKEN_ID_BYTES + _document_ids(inputs, tokens))
        if flat < last:
            total += n * hidden
        else:
            # at T > 1 the logits of a micro-batch in flight are its saved softmax (`act.loss_in_logits`)
            t = inputs.tensor_parallel_size
            logits = 0.0 if act.loss_in_logits(t) else act.logits_bytes(m, inputs.micro_batch_size, t)
            total += n * (logits + tokens * (TOKEN_ID_BYTES + LOSS_MASK_BYTES))
    return total, persistent


def pipe_buffers(inputs: MemoryInputs, stage: int, num_stages: int) -> tuple[float, float]:
    """(DeepSpeed PipelineEngine buffers at a backward, the part of them still held at the
    optimizer step), read from deepspeed/runtime/pipe/engine.py (the plain engine keeps only the
    micro-batch it loaded, `training/plain_engine.py`):

    * a stage after the first keeps each received activation until `_exec_send_grads` frees it
      (in_flight of them) plus the receive buffer `pipe_recv_buf`, which persists;
    * a stage before the last keeps each output until its backward (in_flight) plus the gradient
      receive buffer `grad_layer`, which persists;
    * the last stage's output is the fp32 logits, and `_exec_backward_pass` returns before it
      clears `pipe_buffers['outputs']` on the last stage, so every slot keeps its logits until the
      slot is reused: min(num_pipe_buffers, M) of them, also through the optimizer step (measured:
      two logits buffers on the last stage by `benchmarks/stage_memory.py`); at T > 1 some of them are
      also a micro-batch's saved softmax or stored gradient at a backward (`logits_counted_twice`);
    * token ids on the first stage, labels and loss mask on the last, kept in every slot used;
    * under sequence parallelism each message is this rank's part of the sequence (sent whole: the
      engine's own partitioning is off), and a column-parallel linear's all-gathered (s, b, h) input is
      alive in each backward;
    * with packed documents every activation buffer and the first stage's inputs also hold the whole
      sample's two int64 id tensors (`DOCUMENT_ID_BYTES` per token).
    """
    m, mb = inputs.model, inputs.num_micro_batches
    whole = m.seq_length * inputs.micro_batch_size * m.hidden_size * PRECISION_BYTES[inputs.precision]
    tokens = m.seq_length * inputs.micro_batch_size
    hidden = whole / inputs.split.replicated + _document_ids(inputs, tokens)  # sequence parallelism: the part
    if inputs.engine == "plain":  # the micro-batch it loaded: tokens, labels, loss mask (Ulysses: views of them)
        loaded = tokens * (2 * TOKEN_ID_BYTES + LOSS_MASK_BYTES) + _document_ids(inputs, tokens)
        return loaded, loaded
    schedule = inputs.pipeline_schedule
    slots = min(pipeline_schedules.pipe_buffers(schedule, mb, num_stages, stage), mb)
    flight = in_flight(inputs, stage, num_stages)[0]
    total = persistent = 0.0
    if stage > 0:
        total += (flight + 1) * hidden
        persistent += hidden
    if stage < num_stages - 1:
        total += (flight + 1) * hidden
        persistent += hidden
    else:
        logits = slots * act.logits_bytes(m, inputs.micro_batch_size, inputs.tensor_parallel_size, inputs.ulysses_size)
        total += logits
        persistent += logits
    if stage == 0:
        total += slots * (tokens * TOKEN_ID_BYTES + _document_ids(inputs, tokens))
        persistent += slots * (tokens * TOKEN_ID_BYTES + _document_ids(inputs, tokens))
    if stage == num_stages - 1:
        total += slots * tokens * (TOKEN_ID_BYTES + LOSS_MASK_BYTES)
        persistent += slots * tokens * (TOKEN_ID_BYTES + LOSS_MASK_BYTES)
    if inputs.sequence_parallel:
        # a column-parallel linear's all-gathered (s, b, h) input (`weight_grad.linear`), alive while its
        # backward computes the weight gradient; freed before the optimizer step
        total += whole
    return total, persistent


def _logits_slots(inputs: MemoryInputs, stage: int, num_stages: int) -> tuple[int, float]:
    """(pipe-buffer slots holding logits, bytes of one micro-batch's logits) on the last stage of a
    one-chunk pipeline whose loss works in its logits (`act.loss_in_logits`); (0, 0) elsewhere."""
    schedule, mb = inputs.pipeline_schedule, inputs.num_micro_batches
    if stage != num_stages - 1 or inputs.engine != "pipeline" or schedule.virtual:
        return 0, 0.0
    if not act.loss_in_logits(inputs.tensor_parallel_size):
        return 0, 0.0
    slots = min(pipeline_schedules.pipe_buffers(schedule, mb, num_stages, stage), mb)
    return slots, act.logits_bytes(inputs.model, inputs.micro_batch_size, inputs.tensor_parallel_size)


def _stored_logits(inputs: MemoryInputs, pending: int) -> int:
    """Weight passes' stores (ZB-H1) whose LM-head output gradient is the float32 logits' storage: the
    linear stores the gradient it is given (`weight_grad._Linear.backward`), which in float32 is the loss's
    in-place one (`logits_to_fp32` returns the logits themselves); a 16-bit run stores its cast's copy."""
    return pending if PRECISION_BYTES[inputs.precision] == 4 else 0


def logits_counted_twice(inputs: MemoryInputs, stage: int, num_stages: int, flight: int, pending: int) -> float:
    """Of `pipe_buffers`' logits on the last stage, the bytes that are also a micro-batch's activations or
    weight-pass store at a moment with `flight` micro-batches in flight and `pending` stores.

    Under the vocabulary-parallel loss (T > 1) a micro-batch's logits are its saved softmax until its
    backward, then its logits' gradient (`act.loss_in_logits`), which a float32 ZB-H1 store keeps until
    its weight pass. On the last stage each forward is followed by its own backward and weight passes run
    in backward order, so the slots hold the latest forwards' logits and the micro-batches in flight,
    then those whose stores wait, are the latest forwards: min(slots, in flight + such stores) slots.
    """
    slots, logits = _logits_slots(inputs, stage, num_stages)
    return min(slots, flight + _stored_logits(inputs, pending)) * logits


def refilled_slot_logits(inputs: MemoryInputs, stage: int, num_stages: int, flight: int, pending: int) -> float:
    """What the forward right before a backward on the last stage holds beyond that backward's moment
    (`flight` and `pending` as there), under the vocabulary-parallel loss: DeepSpeed's
    `_exec_forward_pass` stores the forward's output in `pipe_buffers['outputs'][buffer_id]` only after
    `super().forward(inputs)` has returned, so the slot it refills still holds an earlier micro-batch's
    logits while the new ones (its saved softmax) exist; those are counted nowhere else when that
    micro-batch is neither in flight nor storing (the last stage's own moments hold one slot fewer:
    `logits_counted_twice`). At T = 1 the loss's gradients at the backward exceed this. A backward's own
    micro-batch is in flight (`flight` >= 1); M = 1's stand-in moment after it (`flight` 0) had no forward."""
    slots, logits = _logits_slots(inputs, stage, num_stages)
    return logits if 0 <= flight - 1 < slots - _stored_logits(inputs, pending) else 0.0
