"""Every spec's memory on one GPU (`SpecMemory`): its parameters, gradients, optimizer and host states as ZeRO
and expert parallelism partition them, the activations one micro-batch saves in it (and in a recomputed layer,
its checkpointed input), and the tensors whose weight gradients a split backward defers. Pure: no torch.

The terms come from `activation_memory.py` and `attention_activations.py` (a layer's saved tensors, by sliding
window), `moe_costs.py` (a layer with experts) and `distillation_costs.py` (the kd loss's); the state bytes per
parameter from `model_states.py` (`MemoryInputs.factors`). `memory_model.py` sums a stage's and a rank's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from megatron_ds.estimate import activation_memory as act
from megatron_ds.estimate import distillation_costs, moe_costs
from megatron_ds.estimate.attention_activations import MLP_HALF
from megatron_ds.estimate.memory_inputs import MemoryInputs, SpecMemory
from megatron_ds.estimate.model_states import PRECISION_BYTES
from megatron_ds.model import naming, shapes


def _partitioned(factor: Callable[[int, int], float], n: int, experts: int, dp: int, ep: int) -> float:
    """Bytes of `n` parameters' state by `factor(count, ZeRO partition size)`: the experts' share partitioned over
    the expert-data-parallel group (dp / E ranks: DeepSpeed's ZeRO takes each expert group apart), the rest over dp."""
    if not experts:
        return factor(n, dp)
    return factor(n - experts, dp) + factor(experts, max(1, dp // ep))


@functools.lru_cache(maxsize=256)
def spec_memory(inputs: MemoryInputs, one_layer: bool = False) -> tuple[SpecMemory, ...]:
    """Every spec of the GPT in spec-index order (see `megatron_ds.model.naming.gpt_spec_groups`); with
    `one_layer` only the first transformer layer of the body (the others are its copies)."""
    m, t = inputs.model, inputs.tensor_parallel_size
    groups = naming.gpt_spec_groups(m)
    ends, windows = _end_terms(inputs, groups.post[1]), _layer_terms_by_window(inputs)
    params = shapes.gpt_spec_params(m, t, inputs.expert_parallel_size)
    numels = shapes.gpt_spec_tensor_numels(m, t)
    out: list[SpecMemory] = []
    bodies: dict[int | None, SpecMemory] = {}  # the layers of one sliding window have the same figures: made once
    for idx, name in enumerate(groups.names):
        group, layer = groups.group_of(idx), idx - len(groups.pre)
        window = m.layer_windows[layer] if group == "body" else None
        body = bodies.get(window)
        if group == "body" and body is not None and not m.is_moe:  # MoE: the layers with experts differ
            if not one_layer:
                out.append(dataclasses.replace(body, index=idx, name=name))
            continue
        terms = _layer_terms(inputs, windows[window], layer) if group == "body" else ends[name]
        out.append(_one_spec(inputs, idx, name, group, terms, params[idx], numels[idx]))
        if group == "body":
            bodies[window] = out[-1]
    return tuple(out)


def _end_terms(inputs: MemoryInputs, head: str) -> dict[str, dict[str, float]]:
    """The activation terms each pre and post spec saves, by spec name (`head`: the LM head's); a distilling run's kd
    loss saves its tensors with the lm loss's."""
    m, b, k, split = inputs.model, inputs.micro_batch_size, inputs.kernels, inputs.split
    pre = act.pre_terms(m, b, k, regularization=inputs.regularization, split=split)
    terms = {**pre, **act.post_terms(m, b, k, head, split)}
    if inputs.teacher is not None:  # the kd loss's saved tensors sit with the lm loss's
        kd = distillation_costs.kd_loss_terms(m, b, inputs.tensor_parallel_size)
        terms[naming.LOGITS_TO_FP32] = {**terms[naming.LOGITS_TO_FP32], **kd}
    return terms


def _layer_terms_by_window(inputs: MemoryInputs) -> dict[int | None, dict[str, float]]:
    """A dense transformer layer's activation terms for each sliding window the model's layers use."""
    m = inputs.model
    return {
        w: act.transformer_layer_terms(
            m,
            inputs.micro_batch_size,
            inputs.kernels,
            inputs.split,
            regularization=inputs.regularization,
            document_mask=inputs.document_mask,
            window=w,
            position_ids=inputs.document_ids,
        )
        for w in set(m.layer_windows)
    }


def _layer_terms(inputs: MemoryInputs, dense: dict[str, float], layer: int) -> dict[str, float]:
    """Transformer layer `layer`'s activation terms: `dense` (its window's), or a layer with experts' (`moe_costs`)."""
    num_experts = inputs.model.experts_per_layer[layer] if inputs.model.is_moe else 1
    return _moe_layer_terms(inputs, dense, num_experts) if num_experts > 1 else dense


def _one_spec(
    inputs: MemoryInputs,
    idx: int,
    name: str,
    group: str,
    terms: dict[str, float],
    params: shapes.SpecParams,
    numels: tuple[int, ...],
) -> SpecMemory:
    """Spec `idx`: its model states from its parameters (`params`; `numels`: elements per tensor on this tensor
    rank), the activations it saves from `terms`, and its tensors whose weight gradients a split backward defers."""
    saved = sum(terms.values())
    deferrable = _deferrable(inputs, name, group)
    rest = list(numels)
    for x in deferrable:
        rest.remove(x)
    return SpecMemory(
        index=idx,
        name=name,
        group=group,
        num_params=params.num_params,
        largest_param=params.largest,
        **_model_state_bytes(inputs, params, numels),
        activations=saved,
        checkpointed_activations=(
            act.checkpointed_layer_bytes(
                inputs.model,
                inputs.micro_batch_size,
                inputs.kernels,
                inputs.split,
                inputs.document_ids,
                partitioned=inputs.partition_activations,
                on_host=inputs.checkpoint_in_cpu,
            )
            if group == "body"
            else saved
        ),
        activation_terms=dict(terms),
        tied=name == naming.TIED_LM_HEAD,
        no_decay_params=params.no_decay,
        deferrable_params=sum(deferrable),
        largest_deferrable=max(deferrable, default=0),
        largest_undeferred=max(rest, default=0),
    )


def _model_state_bytes(inputs: MemoryInputs, params: shapes.SpecParams, numels: tuple[int, ...]) -> dict[str, float]:
    """A spec's parameters, gradients, optimizer and host states in bytes per rank, partitioned as ZeRO and expert
    parallelism partition them."""
    n, experts, fac = params.num_params, params.expert_params, inputs.factors
    dp, ep = inputs.data_parallel_size, inputs.expert_parallel_size
    threshold = inputs.zero3_persistence_threshold if inputs.zero_stage == 3 else -1
    # ZeRO-3's persistent tensors are whole on every rank besides their partition
    persistent = sum(x for x in numels if x <= threshold) * PRECISION_BYTES[inputs.precision]
    return {
        "params": _partitioned(fac.params, n, experts, dp, ep) + persistent,
        "grads": _partitioned(fac.grads, n, experts, dp, ep),
        "optimizer": _partitioned(fac.optimizer, n, experts, dp, ep),
        "host": _partitioned(fac.host, n, experts, dp, ep),
    }


def _moe_layer_terms(inputs: MemoryInputs, layer_terms: dict[str, float], num_experts: int) -> dict[str, float]:
    """A layer with experts: the dense layer's terms with its MLP's replaced by the MoE layer's (`moe_costs`)."""
    m = inputs.model
    dense_mlp = (*MLP_HALF, f"{m.activation} inputs")
    out = {name: v for name, v in layer_terms.items() if name not in dense_mlp}
    b, w = inputs.micro_batch_size, PRECISION_BYTES[inputs.precision]
    return {**out, **moe_costs.mlp_terms(m, b, num_experts, w)}


def _deferrable(inputs: MemoryInputs, name: str, group: str) -> tuple[int, ...]:
    """The spec's parameter tensors (elements per tensor rank) whose gradients `model/weight_grad.py`'s linears
    compute: a transformer layer's four linear weights and the LM head, tied or not."""
    m, t = inputs.model, inputs.tensor_parallel_size
    if group == "body":
        return tuple(rows * cols // t for rows, cols in shapes.layer_linear_shapes(m).values())
    if name in (naming.TIED_LM_HEAD, naming.UNTIED_LM_HEAD):
        return (shapes.word_embedding_params(m, t),)
    return ()
