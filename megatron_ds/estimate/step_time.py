"""One training step in seconds: per-stage times from `layer_time`, communication from `communication`,
the optimizer step from bytes, replayed through the pipeline schedule (`step_simulator`); what is timed and the
result are `step_inputs.py`'s `StepInputs` and `StepTime`. Pure: no torch.

Per flat stage (v x P of them with the interleaved schedule's v chunks per rank; flat stage c x P + r is
chunk c of rank r, megatron-core's numbering) and micro-batch: forward = pre (flat stage 0) + k layers +
post (the last flat stage); backward the same
backward passes plus one forward of every recomputed layer (full recomputation, DeepSpeed's chunks:
`stage_contents.recomputed_layers`). Between stages each micro-batch's activation (b s h) goes forward and its
gradient back, over the network when stages sit on different nodes (`communication.Placement`); 1/t of it
per tensor rank with Megatron's scatter-gather, then all-gathered on the node (`_send_time`); none with
overlapped sends (interleaved only, as upstream); with v chunks every chunk
boundary is a transfer (v x the traffic; the interleaved schedule posts its sends). Per rank, its chunks
together, after the last backward:
  the tied embedding's gradient all-reduce between the first and the last stage (a tied model, P > 1);
  the data-parallel reduction of the stage's gradients, exposed as `RunFeatures.dp_mode` says:
      after-backward  all of it, after the stage's last backward (other stages still compute);
      overlap-last    what outlasts the last micro-batch's backward; with `delay_grad_reduce` only on
                      the first stage, the others reduce after their last backward (the gather still
                      hides behind the next forward);
      overlap-each    every micro-batch reduces its own gradients during its backward (ZeRO-2/3): what
                      outlasts each backward is added to it; ZeRO-3 also gathers the parameters for
                      every forward and backward, counted whole (its gathers run layer by layer, each
                      a wait on the network: "latency on the critical path", plan/guides/zero.txt);
      a reduction is an all-reduce (ZeRO-0) or a reduce-scatter, and the updated parameters' all-gather
      after the step (a partitioned optimizer);
  the optimizer step: Adam reads and writes its fp32 master weights and two moments, reads the fp32
      gradient and writes the 16-bit weights (`ADAM_BYTES`), over 1/d of the stage's parameters when
      partitioned; the gradient norm reads every local gradient once.
The step is the simulated schedule's length; above `SIMULATE_LIMIT` micro-batches x stages (the replay is
O(M P) in Python) it is 1F1B's closed form instead (`closed_form_step`: exact for equal stages, the
tests compare it with the replay), and `StepTime.simulated` says which. Throughput is reported in model FLOPs (Megatron-LM's
`num_floating_point_operations`: forward and backward matmuls, no recomputation) per second and GPU,
and in the FLOPs the hardware ran (recomputation included: Narayanan et al. 2021, eq. 3's counting).
"""

from __future__ import annotations

from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.estimate import distillation_costs
from megatron_ds.estimate.communication import Links, Placement
from megatron_ds.estimate.compute import model_flops_per_iteration
from megatron_ds.estimate.efficiency import Kernels
from megatron_ds.estimate.layer_time import PassTimes, layer_times, post_times, pre_times
from megatron_ds.estimate.model_states import PRECISION_BYTES
from megatron_ds.estimate.run_features import DP_AFTER_BACKWARD, DP_OVERLAP_EACH, DP_OVERLAP_LAST, RunFeatures
from megatron_ds.estimate.stage_contents import recomputed_layers
from megatron_ds.estimate.step_bounds import closed_form_step, last_stage_path_bound, start_and_work_bound
from megatron_ds.estimate.step_inputs import StepInputs, StepTime
from megatron_ds.estimate.step_simulator import simulate

SIMULATE_LIMIT = 4096
"""Micro-batches x stages up to which the step is replayed instruction by instruction."""
ADAM_BYTES_FP32_STATES = 28
"""Per updated parameter: read and write the fp32 master, the two moments (24) and read the fp32 gradient (4)."""


def _stage_passes(
    inp: StepInputs, kernels: Kernels, links: Links, features: RunFeatures
) -> tuple[list[float], list[float], dict, list[float]]:
    """Per flat stage: one micro-batch's forward and backward (recomputation included), the slowest rank's
    parts (its chunks together), and the weight-gradient part of each backward; pre on flat stage 0, post on the last."""
    w = PRECISION_BYTES[inp.precision]
    place = Placement(inp.tp, inp.pp, inp.dp, inp.gpus_per_node, inp.expert_parallel_size)
    experts = inp.model.experts_per_layer
    kinds = {
        n: layer_times(
            inp.model, inp.micro_batch_size, inp.tp, w, kernels, links, features, inp.attention_dropout,
            num_experts=n, all_to_all=(inp.expert_parallel_size, place.ep_within_node),
        )
        for n in sorted(set(experts))
    }  # fmt: skip
    pre = pre_times(inp.model, inp.micro_batch_size, inp.tp, w, kernels, links)
    post = post_times(inp.model, inp.micro_batch_size, inp.tp, w, kernels, links, features)
    forward, backward, weight, flat_parts = [], [], [], []
    p = inp.num_flat
    interval = inp.checkpoint_num_layers if inp.checkpoint_activations else 0
    keys = list(dict.fromkeys(key for t in kinds.values() for key in t.parts))
    priced: dict[tuple, tuple[float, float, float, dict]] = {}  # a deep model's stages are mostly alike
    first = 0  # flat stages hold the layers in order
    for s, k in enumerate(inp.layers_per_stage):
        counts = tuple(experts[first : first + k].count(n) for n in kinds)
        first += k
        shape = (counts, s == 0, s == p - 1)
        if shape not in priced:
            priced[shape] = _one_stage(kinds, counts, k, pre if s == 0 else None, post if s == p - 1 else None,
                                       interval, inp.selective_recompute, keys)  # fmt: skip
        f, b, wt, parts = priced[shape]
        forward.append(f)
        backward.append(b)
        weight.append(wt)
        flat_parts.append(parts)  # shared between alike stages: read only
    if inp.teacher is not None:  # after the student's forward on its one stage (P = 1)
        kd_f, kd_b, kd_parts = distillation_costs.step_times(
            inp.teacher, inp.micro_batch_size, inp.tp, w, kernels, links, features,
            all_to_all=(inp.expert_parallel_size, place.ep_within_node),
        )  # fmt: skip
        forward[-1] += kd_f
        backward[-1] += kd_b
        flat_parts[-1] = {**flat_parts[-1], **kd_parts}
    ranks, v = inp.pp, inp.virtual_stages
    busy = [sum(forward[c * ranks + r] + backward[c * ranks + r] for c in range(v)) for r in range(ranks)]
    slowest = max(range(ranks), key=lambda r: (busy[r], r))  # the last of equals, as before
    chunks = [flat_parts[c * ranks + slowest] for c in range(v)]
    parts = {key: sum(part[key] for part in chunks) for key in chunks[0]}
    return forward, backward, parts, weight


def _one_stage(
    kinds: dict[int, PassTimes],
    counts: tuple[int, ...],
    k: int,
    pre: PassTimes | None,
    post: PassTimes | None,
    interval: int,
    selective: bool,
    keys: list[str],
) -> tuple[float, float, float, dict]:
    """One flat stage of `k` layers (`counts` of each kind), with the pre and post groups it holds: one
    micro-batch's forward, backward (recomputation included), weight-gradient part and parts by term."""
    layers: list[tuple[PassTimes, int]] = [(t, c) for t, c in zip(kinds.values(), counts) if c]
    held = layers + ([(pre, 1)] if pre is not None else []) + ([(post, 1)] if post is not None else [])
    again = recomputed_layers(1 if pre is not None else 0, k, 1 if post is not None else 0, interval)
    mean = sum(t.recompute * c for t, c in layers) / k if k else 0.0  # the recomputed layers' average
    redo = again * mean + (sum(t.attention_recompute * c for t, c in layers) if selective else 0.0)
    forward = sum(t.forward * n for t, n in held)
    backward = sum(t.backward * n for t, n in held) + redo
    weight = sum(t.weight * n for t, n in held)
    parts = {key: sum(t.parts.get(key, 0.0) * n for t, n in held) for key in keys}
    parts["recompute"] = redo
    return forward, backward, weight, parts


def _dp_times(
    inp: StepInputs, links: Links, features: RunFeatures, forward: list[float], backward: list[float]
) -> tuple[list[float], list[float]]:
    """Per rank: the exposed reduction after the last backward, and the exposure added to each micro-batch's
    passes (ZeRO-2/3; `forward` and `backward`, per flat stage, are updated: with v chunks a rank's passes of
    one micro-batch are its chunks' together, the exposure lands on chunk 0, whose backward runs last)."""
    place = Placement(inp.tp, inp.pp, inp.dp, inp.gpus_per_node, inp.expert_parallel_size)
    inside, d, w = place.dp_within_node, inp.dp, PRECISION_BYTES[inp.precision]
    g = place.dp_ranks_per_node
    partitioned = features.partitioned_optimizer or inp.zero_stage >= 1
    p, v = inp.pp, inp.virtual_stages
    out, per_mb = [], []
    experts = inp.stage_expert_params or (0,) * len(inp.stage_params)
    ed = place.experts_data_parallel  # the experts' state: over d / E ranks, E apart
    for r, (params, expert) in enumerate(zip(inp.stage_params, experts)):
        chunks = [c * p + r for c in range(v)]
        rank_forward, rank_backward = sum(forward[i] for i in chunks), sum(backward[i] for i in chunks)
        dense, fb = params - expert, features.grad_bytes
        gather = links.reduce_scatter(dense * w, d, inside, g) if partitioned else 0.0
        if partitioned:
            reduce = links.reduce_scatter(dense * fb, d, inside, g)
        else:
            reduce = links.all_reduce(dense * fb, d, inside, g)
        if expert:
            e_args = (ed.dp, ed.dp_within_node, ed.dp_ranks_per_node)
            gather += links.reduce_scatter(expert * w, *e_args) if partitioned else 0.0
            reduce += (links.reduce_scatter if partitioned else links.all_reduce)(expert * fb, *e_args)
        if features.dp_mode == DP_OVERLAP_EACH or inp.zero_stage >= 2:
            exposed = max(0.0, reduce - rank_backward) + (2 * gather if inp.zero_stage == 3 else 0.0)
            backward[r] += exposed - (gather if inp.zero_stage == 3 else 0.0)
            forward[r] += gather if inp.zero_stage == 3 else 0.0  # layer-by-layer gathers wait on the network
            per_mb.append(exposed)
            out.append(0.0 if inp.zero_stage == 3 else gather)
            continue
        per_mb.append(0.0)
        if features.dp_mode == DP_OVERLAP_LAST and features.delay_grad_reduce and r > 0:
            out.append(reduce + max(0.0, gather - rank_forward))  # reduced in the bubble, after the backward
        elif features.dp_mode == DP_OVERLAP_LAST:
            out.append(max(0.0, reduce + gather - rank_backward - rank_forward))
        else:
            assert features.dp_mode == DP_AFTER_BACKWARD
            out.append(reduce + gather)
    return out, per_mb


def _optimizer_times(inp: StepInputs, kernels: Kernels, features: RunFeatures) -> list[float]:
    w = PRECISION_BYTES[inp.precision]
    partitioned = features.partitioned_optimizer or inp.zero_stage >= 1
    out = []
    experts = inp.stage_expert_params or (0,) * len(inp.stage_params)
    for params, expert in zip(inp.stage_params, experts):  # the experts' partitions over d / E ranks
        updated = (params - expert) / inp.dp + expert / (inp.dp // inp.expert_parallel_size) if partitioned else params
        state_bytes = ADAM_BYTES_FP32_STATES + (w if w < 4 else 0)  # the 16-bit copy written back
        out.append(kernels.memory(updated * state_bytes + params * 4))  # + the norm's read of every gradient
    return out


def _send_time(inp: StepInputs, links: Links, features: RunFeatures, place: Placement) -> float:
    """One micro-batch's activation (or its gradient) from a stage to the next, as the rendezvous the
    simulator puts on the path; one per chunk boundary (the program has v x the sends with virtual stages).
    Megatron's p2p overlap exists only under the interleaved schedule (megatron/training/arguments.py sets
    `overlap_p2p_comm = False` without virtual stages), so 1F1B and ZB-H1 sends stay blocking. With the
    scatter/gather optimization each tensor rank sends 1/t across nodes and the receiver all-gathers the
    tensor over its node's tensor group before using it (Megatron-LM 2021 `p2p_communication._communicate`:
    `split_tensor_into_1d_equal_chunks`, the send, `torch.cuda.synchronize()`, `gather_split_1d_tensor`);
    under sequence parallelism the message is already the rank's sequence shard, with no gather."""
    if inp.pp == 1 or (features.p2p_overlap and inp.virtual_stages > 1):
        return 0.0
    activation = inp.micro_batch_size * inp.model.seq_length * inp.model.hidden_size * PRECISION_BYTES[inp.precision]
    cross = not place.stages_within_node
    if not (features.p2p_scatter_gather and cross):
        return links.send(activation, not cross)
    gather = 0.0 if features.sequence_parallel else links.reduce_scatter(activation, inp.tp, within_node=True)
    return links.send(activation / inp.tp, within_node=False) + gather


def layout_bound(inp: StepInputs, kernels: Kernels, links: Links, features: RunFeatures) -> float:
    """This layout under its schedule steps no faster: its stage passes alone (`step_bounds.start_and_work_bound`)
    and, with one stage per rank, the last stage's path (`step_bounds.last_stage_path_bound`, the sends
    included); no reduction or optimizer step; `stage_params` is not read."""
    forward, backward, _, weight = _stage_passes(inp, kernels, links, features)
    bound = start_and_work_bound(forward, backward, inp.num_micro_batches, inp.pp)
    if inp.virtual_stages > 1:
        return bound
    send = _send_time(inp, links, features, Placement(inp.tp, inp.pp, inp.dp, inp.gpus_per_node))
    return max(bound, last_stage_path_bound(forward, backward, weight, inp.num_micro_batches, send, inp.schedule))


def _step_seconds(
    inp: StepInputs,
    features: RunFeatures,
    passes: tuple[list[float], list[float], list[float]],
    optimizer: list[float],
    reduce: list[float],
    between: tuple[float, float, bool],
) -> tuple[float, bool]:
    """The step's seconds, and whether the schedule was replayed instruction by instruction (else 1F1B's closed
    form, beyond `SIMULATE_LIMIT`): `passes` per flat stage (forward, backward, weight part), `optimizer` and
    `reduce` per rank, `between` the send, the tied embedding's reduction and whether there is one."""
    (forward, backward, weight), (send, tied_reduce, tied) = passes, between
    m_total = inp.num_micro_batches
    simulated = (
        m_total * inp.pp <= SIMULATE_LIMIT or inp.schedule != DEFAULT_PIPELINE_SCHEDULE
    )  # the closed form is 1F1B's
    if simulated:
        # the simulator sums a rank's optimizer over its chunks: the rank's whole step on chunk 0
        flat_optimizer = optimizer + [0.0] * (inp.num_flat - inp.pp)
        seconds = simulate(
            m_total,
            forward,
            backward,
            flat_optimizer,
            send=send,
            tied_reduce=tied_reduce,
            tied=tied,
            grad_norm_sync=features.grad_norm_sync,
            schedule=inp.schedule,
            reduce_grads=reduce,
            weight=weight,
            virtual_stages=inp.virtual_stages,
        ).step_time
    else:
        seconds = closed_form_step(m_total, forward, backward, optimizer, reduce, send, tied_reduce)
    return seconds, simulated


def predict_step(inp: StepInputs, kernels: Kernels, links: Links, features: RunFeatures) -> StepTime:
    """The step's seconds and throughput for this configuration on this device and network."""
    if inp.num_flat % inp.virtual_stages or len(inp.stage_params) != inp.pp:
        raise ValueError(
            f"{inp.num_flat} flat stages, {inp.virtual_stages} chunks per rank and {len(inp.stage_params)} ranks' "
            f"parameters do not agree"
        )
    place = Placement(inp.tp, inp.pp, inp.dp, inp.gpus_per_node)
    forward, backward, parts, weight = _stage_passes(inp, kernels, links, features)
    reduce, per_mb = _dp_times(inp, links, features, forward, backward)
    optimizer = _optimizer_times(inp, kernels, features)
    model = inp.model
    send = _send_time(inp, links, features, place)
    tied = not model.untie_embeddings_and_output_weights and inp.pp > 1
    embedding = model.vocab_size // inp.tp * model.hidden_size * features.grad_bytes
    tied_reduce = links.all_reduce(embedding, 2, place.ends_within_node) if tied else 0.0
    m_total = inp.num_micro_batches
    seconds, simulated = _step_seconds(
        inp, features, (forward, backward, weight), optimizer, reduce, (send, tied_reduce, tied)
    )
    gbs = inp.global_batch_size
    busy = [
        sum(forward[c * inp.pp + r] + backward[c * inp.pp + r] for c in range(inp.virtual_stages))
        for r in range(inp.pp)
    ]
    return StepTime(
        seconds=seconds,
        forward=tuple(forward),
        backward=tuple(backward),
        optimizer=tuple(optimizer),
        reduce_grads=tuple(reduce),
        dp_per_micro_batch=tuple(per_mb),
        send=send,
        tied_reduce=tied_reduce,
        model_flops=float(model_flops_per_iteration(model, gbs)),
        hardware_flops=float(model_flops_per_iteration(model, gbs, recompute=inp.checkpoint_activations))
        + (distillation_costs.forward_flops(inp.teacher, gbs * model.seq_length) if inp.teacher else 0.0),
        num_gpus=inp.num_gpus,
        tokens=gbs * model.seq_length,
        peak_flops=kernels.peak_flops,
        parts=parts,
        ideal=m_total * sum(busy) / len(busy) + max(optimizer),
        simulated=simulated,
        virtual_stages=inp.virtual_stages,
    )
