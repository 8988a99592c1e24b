"""What no layout of a configuration steps faster than, and 1F1B's step without replaying it: the planner's
branch-and-bound bound (`step_lower_bound`) and `step_time`'s closed form beyond its replay limit. Pure: no torch."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_ds.config import ModelConfig
from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.estimate import pipeline_schedules
from megatron_ds.estimate.communication import Links
from megatron_ds.estimate.efficiency import Kernels
from megatron_ds.estimate.layer_time import layer_times, post_times, pre_times
from megatron_ds.estimate.model_states import PRECISION_BYTES
from megatron_ds.estimate.run_features import RunFeatures


def closed_form_step(
    num_micro_batches: int,
    forward: Sequence[float],
    backward: Sequence[float],
    optimizer: Sequence[float],
    reduce_grads: Sequence[float],
    send: float,
    tied_reduce: float,
) -> float:
    """1F1B's step without replaying it: the fill and drain through every stage once, the slowest stage's
    steady state for the other M - 1 micro-batches, the sends on the critical path, then each stage's reduction after
    its last backward (stage s ends the backwards of the stages before it later), the tied all-reduce, the
    norm barrier and the slowest optimizer step."""
    p, m = len(forward), num_micro_batches
    busy = [f + b for f, b in zip(forward, backward)]
    compute = sum(busy) + (m - 1) * max(busy) + sends_on_path(m, p) * send
    ends = [compute - sum(backward[:s]) + reduce_grads[s] for s in range(p)]
    return max(ends) + (tied_reduce if p > 1 else 0.0) + max(optimizer)


def step_lower_bound(
    model: ModelConfig,
    micro_batch_size: int,
    num_micro_batches: int,
    tp: int,
    pp: int,
    precision: str,
    checkpoint_activations: bool,
    kernels: Kernels,
    links: Links,
    features: RunFeatures,
    schedule: str = DEFAULT_PIPELINE_SCHEDULE,
    selective_recompute: bool = False,
) -> float:
    """No layout of this configuration steps faster, under any schedule; communication only adds to it.

    1F1B: the fill and drain through every stage, (M + P - 1) x the mean stage's compute (every stage's
    compute lies on one path, and the slowest stage's M - 1 others are at least the mean).
    ZB-H1 (any schedule of one stage per rank): rank r's first pass waits for micro-batch 0's forward through stages
    0..r-1, so the step is at least M X_r + phi S_r, with X_r the stage's compute per micro-batch, S_r
    the sum of X over the stages before it and phi the smallest forward share of a piece (layer, pre,
    post). Weighting the P inequalities by q^(P-1-r), q = 1 - phi/M, makes every X's coefficient M, so
    the step is at least phi T / (1 - q^P) for T the total compute, whatever the layout.
    Interleaved: some rank runs at least the mean rank's compute, M times (M x the mean)."""
    w = PRECISION_BYTES[precision]
    layer = layer_times(model, micro_batch_size, tp, w, kernels, links, features)
    pre = pre_times(model, micro_batch_size, tp, w, kernels, links)
    post = post_times(model, micro_batch_size, tp, w, kernels, links, features)
    per_layer = layer.forward + layer.backward + (layer.recompute if checkpoint_activations else 0.0)
    per_layer += layer.attention_recompute if selective_recompute and not checkpoint_activations else 0.0
    total = model.num_layers * per_layer + pre.forward + pre.backward + post.forward + post.backward
    m, mean = num_micro_batches, total / pp
    if schedule == DEFAULT_PIPELINE_SCHEDULE:
        return (m + pp - 1) * mean
    if pp > 1 and not pipeline_schedules.find(schedule).virtual:  # one stage per rank (ZB-H1)
        shares = [t.forward / (t.forward + t.backward) for t in (pre, post) if t.forward + t.backward > 0]
        phi = min([layer.forward / per_layer, *shares])
        return phi * total / (1.0 - (1.0 - phi / m) ** pp)
    return m * mean


def start_and_work_bound(
    forward: Sequence[float], backward: Sequence[float], num_micro_batches: int, num_ranks: int
) -> float:
    """No schedule steps these stage passes faster (per flat stage, one micro-batch; flat stage c x P + r is
    chunk c of rank r): rank r computes nothing before micro-batch 0's forward has passed the flat stages
    before its first chunk, then runs every pass of its M micro-batches, one at a time."""
    p, m = num_ranks, num_micro_batches
    out, before = 0.0, 0.0
    for r in range(p):
        busy = sum(forward[f] + backward[f] for f in range(r, len(forward), p))
        out = max(out, before + m * busy)
        before += forward[r]
    return out


def last_stage_path_bound(
    forward: Sequence[float],
    backward: Sequence[float],
    weight: Sequence[float],
    num_micro_batches: int,
    send: float,
    schedule: str,
) -> float:
    """One path of the replay with one stage per rank, read off the schedule's stream (its registry entry's
    `last_stage_path`; 0 where it has none): micro-batch 0's forward to the last stage, every pass the last
    stage runs up to its last backward, then micro-batch M - 1's backward back to stage 0, a transfer per hop."""
    path = pipeline_schedules.find(schedule).last_stage_path
    if len(forward) < 2 or path is None:
        return 0.0
    return path(forward, backward, weight, num_micro_batches, send)


def sends_on_path(num_micro_batches: int, num_stages: int) -> int:
    """Blocking sends on the critical path of DeepSpeed's 1F1B with equal stages (`step_simulator`'s
    rendezvous model, counted off its replay; the tests check it for many sizes): the fill and drain's
    2 (P - 1), or in steady state four per micro-batch (receive and send each way), P = 2 two."""
    m, p = num_micro_batches, num_stages
    if p == 1:
        return 0
    if p == 2:
        return 2 * m
    return max(2 * (p - 1), 4 * m + 2 * (p - 4))
