"""The step-time model under every registered schedule: interleaving's chunks (flat stages, per-rank
optimizer and reduction, v x the sends), ZB-H1's weight passes, and the lower bound below every prediction."""

from __future__ import annotations

import dataclasses
import random

import pytest

from megatron_ds.config import ModelConfig
from megatron_ds.estimate.communication import Links
from megatron_ds.estimate.devices import find_named
from megatron_ds.estimate.efficiency import Kernels
from megatron_ds.estimate.run_features import deepspeed_features
from megatron_ds.estimate.step_bounds import last_stage_path_bound, start_and_work_bound, step_lower_bound
from megatron_ds.estimate.step_inputs import StepInputs
from megatron_ds.estimate.step_simulator import simulate
from megatron_ds.estimate.step_time import predict_step
from megatron_ds.model.shapes import layer_params

A100 = find_named("A100-80GB")[0]
KERNELS = Kernels.for_device(A100, "bf16")
LINKS = Links.for_device(A100, 8)
SCHEDULES = (("1f1b", 1), ("zbh1", 1), ("interleaved", 2))


def gpt(layers: int = 16, h: int = 2048, heads: int = 16, s: int = 2048) -> ModelConfig:
    return ModelConfig(
        num_layers=layers,
        hidden_size=h,
        num_attention_heads=heads,
        ffn_hidden_size=4 * h,
        seq_length=s,
        max_position_embeddings=s,
        vocab_size=51200,
    )


def inputs(model: ModelConfig, pp: int, m: int, schedule: str = "1f1b", v: int = 1, **kw) -> StepInputs:
    per = model.num_layers // (pp * v)
    return StepInputs(
        model=model,
        layers_per_stage=(per,) * (pp * v),
        stage_params=(layer_params(model).total * per * v,) * pp,
        micro_batch_size=1,
        num_micro_batches=m,
        tp=1,
        dp=kw.pop("dp", 2),
        precision="bf16",
        zero_stage=1,
        checkpoint_activations=kw.pop("ckpt", False),
        gpus_per_node=kw.pop("gpus_per_node", 8),
        schedule=schedule,
        virtual_stages=v,
        **kw,
    )


@pytest.mark.parametrize("schedule,v", SCHEDULES)
@pytest.mark.parametrize("pp,m,ckpt", [(2, 4, False), (2, 8, True), (4, 8, False), (4, 16, True), (8, 16, False)])
def test_the_lower_bound_holds_for_every_schedule(schedule: str, v: int, pp: int, m: int, ckpt: bool) -> None:
    features = deepspeed_features(1, 2)
    inp = inputs(gpt(), pp, m, schedule, v, ckpt=ckpt)
    step = predict_step(inp, KERNELS, LINKS, features)
    bound = step_lower_bound(inp.model, 1, m, 1, pp, "bf16", ckpt, KERNELS, LINKS, features, schedule=schedule)
    assert 0 < bound <= step.seconds * (1 + 1e-9)
    # uneven stages too: a layout cannot beat the bound
    uneven = dataclasses.replace(inp, layers_per_stage=(0, *inp.layers_per_stage[1:-1], 2 * inp.layers_per_stage[-1]))
    assert bound <= predict_step(uneven, KERNELS, LINKS, features).seconds * (1 + 1e-9)


@pytest.mark.parametrize("schedule,v", [*SCHEDULES, ("interleaved", 3)])
def test_the_layout_bound_holds_for_random_stage_times_and_is_tight_on_a_lone_heavy_stage(
    schedule: str, v: int
) -> None:
    """`start_and_work_bound` (the planner's per-layout bound) never exceeds the replayed step, whatever the
    stage times, sends, reductions and optimizer; with one stage far heavier than the rest it is nearly the step."""
    rng = random.Random(7)
    for _ in range(60):
        p = rng.choice((2, 3, 4, 6))
        m = p * rng.choice((1, 2, 3, 5)) if v > 1 else rng.randint(1, 3 * p + 3)
        n = p * v
        forward = [rng.uniform(0.0, 3.0) for _ in range(n)]
        backward = [2 * f + rng.uniform(0.0, 1.0) for f in forward]
        weight = [b * rng.uniform(0.2, 0.5) for b in backward]
        bound = start_and_work_bound(forward, backward, m, p)
        step = simulate(
            m, forward, backward, optimizer=rng.uniform(0, 1), send=rng.uniform(0, 0.3), schedule=schedule,
            weight=weight, virtual_stages=v, reduce_grads=rng.uniform(0, 1),
        ).step_time  # fmt: skip
        assert 0 < bound <= step * (1 + 1e-12), (p, m, forward, backward)
    heavy = [0.01] * (2 * v)
    heavy[1] = 10.0
    bound = start_and_work_bound(heavy, [2 * f for f in heavy], 64, 2)
    step = simulate(64, heavy, [2 * f for f in heavy], schedule=schedule, virtual_stages=v).step_time
    assert bound <= step < 1.01 * bound


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_the_last_stage_path_is_a_path_of_the_replay_and_the_whole_step_on_equal_stages(schedule: str) -> None:
    """`last_stage_path_bound` never exceeds the replayed step (random stage times, sends, reductions, optimizer),
    and on equal stages with free sends it is the step itself: the schedule's bubble, (P - 1)(F + B) for 1F1B and
    (P - 1)(F + B - W) for ZB-H1 (B its input-gradient pass)."""
    rng = random.Random(11)
    for _ in range(80):
        p, m = rng.choice((2, 3, 4, 7)), rng.randint(1, 20)
        forward = [rng.uniform(0.1, 3.0) for _ in range(p)]
        backward = [2 * f + rng.uniform(0.0, 1.0) for f in forward]
        weight = [b * rng.uniform(0.2, 0.5) for b in backward] if schedule == "zbh1" else [0.0] * p
        send = rng.uniform(0, 0.3)
        bound = last_stage_path_bound(forward, backward, weight, m, send, schedule)
        step = simulate(
            m, forward, backward, optimizer=rng.uniform(0, 1), send=send, schedule=schedule, weight=weight,
            reduce_grads=rng.uniform(0, 1),
        ).step_time  # fmt: skip
        assert 0 < bound <= step * (1 + 1e-12), (p, m, forward, backward, weight)
    for p, m in ((2, 1), (4, 3), (4, 8), (8, 32)):
        f, b, w = 1.0, 2.0, (1.0 if schedule == "zbh1" else 0.0)
        equal = simulate(m, [f] * p, [b] * p, schedule=schedule, weight=w, tied=False, grad_norm_sync=False).step_time
        bound = last_stage_path_bound([f] * p, [b] * p, [w] * p, m, 0.0, schedule)
        assert bound == pytest.approx(equal, rel=1e-12), (p, m)
        bubble = (p - 1) * (f + b) if schedule == "1f1b" else (p - 1) * (f + b - 2 * w)
        assert bound == pytest.approx(m * (f + b) + bubble, rel=1e-12) or m < p


def test_interleaving_runs_chunks_on_flat_stages_with_the_ends_on_the_first_and_last() -> None:
    features = deepspeed_features(1, 2)
    one = predict_step(inputs(gpt(), 4, 8), KERNELS, LINKS, features)
    two = predict_step(inputs(gpt(), 4, 8, "interleaved", 2), KERNELS, LINKS, features)
    assert len(two.forward) == 8 and len(two.optimizer) == len(two.reduce_grads) == 4
    # pre on flat stage 0 (rank 0's chunk 0), post on flat stage 7 (rank 3's chunk 1)
    assert two.forward[0] > two.forward[1] and two.forward[7] > two.forward[6] and two.forward[3] == two.forward[4]
    for r in range(4):  # a rank's chunks together do its 1F1B stage's work; its optimizer and reduction alike
        assert two.forward[r] + two.forward[4 + r] == pytest.approx(one.forward[r], rel=1e-9)
        assert two.optimizer[r] == pytest.approx(one.optimizer[r]) and two.reduce_grads[r] == one.reduce_grads[r]
    assert two.seconds < one.seconds  # a (P - 1) / (v M) bubble at M = 8, P = 4
    assert two.model_flops == one.model_flops


def test_interleaving_pays_v_times_the_sends() -> None:
    features = deepspeed_features(1, 2)
    # one GPU per node: every stage boundary crosses the network, so the sends weigh
    cross = {
        s: predict_step(inputs(gpt(), 4, 8, s, v, gpus_per_node=1), KERNELS, LINKS, features) for s, v in SCHEDULES
    }
    near = {s: predict_step(inputs(gpt(), 4, 8, s, v), KERNELS, LINKS, features) for s, v in SCHEDULES}
    assert cross["interleaved"].send == cross["1f1b"].send > near["1f1b"].send
    cost = {s: cross[s].seconds - near[s].seconds for s in cross}
    assert cost["interleaved"] > 0 and cost["1f1b"] > 0


def test_zbh1_is_faster_than_1f1b_with_the_same_work() -> None:
    features = deepspeed_features(1, 2)
    one = predict_step(inputs(gpt(), 4, 8), KERNELS, LINKS, features)
    zb = predict_step(inputs(gpt(), 4, 8, "zbh1"), KERNELS, LINKS, features)
    assert zb.forward == one.forward and zb.backward == one.backward and zb.seconds < one.seconds


def test_mismatched_chunks_and_ranks_are_an_error() -> None:
    inp = inputs(gpt(), 4, 8, "interleaved", 2)
    with pytest.raises(ValueError, match="do not agree"):
        predict_step(
            dataclasses.replace(inp, stage_params=inp.stage_params * 2), KERNELS, LINKS, deepspeed_features(1, 2)
        )
