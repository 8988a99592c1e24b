"""Calibration: positive times for every group, in a fixed structure, and stage times built from them."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_ds.config import ModelConfig
from megatron_ds.estimate.compute import ComputeInputs, stage_flops_for
from megatron_ds.estimate.measured_time import GROUPS, stage_time_fn
from megatron_ds.training.measure.calibrate import calibrate

MODEL = ModelConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    seq_length=16,
    max_position_embeddings=16,
    vocab_size=128,
)


@pytest.fixture(scope="module")
def measured():
    return calibrate(MODEL, micro_batch_size=2, repeats=2, warmup=1)


def test_every_group_is_timed_with_its_flops(measured) -> None:
    assert [t.group for t in measured.timings] == list(GROUPS)
    for t in measured.timings:
        assert t.forward > 0 and t.backward >= 0 and t.forward + t.backward > 0
        assert t.flops > 0 and t.flops_per_second > 0
    inputs = ComputeInputs(MODEL, 2)
    whole = stage_flops_for(inputs, 0, 1, MODEL.num_layers)
    assert (
        sum(t.flops for t in measured.timings) + (MODEL.num_layers - 1) * measured.group("layer").flops == whole.total
    )


def test_structure_does_not_depend_on_the_run(measured) -> None:
    again = calibrate(
        dataclasses.replace(MODEL, activation="swiglu", untie_embeddings_and_output_weights=True), 2, repeats=1
    )
    assert [t.group for t in again.timings] == [t.group for t in measured.timings]
    assert again.tied_copy_optimizer == 0.0  # untied: the output layer is the post group's own


def test_the_tied_head_copy_is_stepped_on_the_last_stage_only_when_it_is_not_the_first(measured) -> None:
    """DeepSpeed builds a tied module once per stage: with one stage the head shares the embedding."""
    pre, layer, post = (measured.group(g) for g in GROUPS)
    assert measured.tied_copy_optimizer > 0
    one = stage_time_fn(measured, ComputeInputs(MODEL, 2), num_stages=1)(0, 4)
    assert one.optimizer == pytest.approx(pre.optimizer + 4 * layer.optimizer + post.optimizer)
    last = stage_time_fn(measured, ComputeInputs(MODEL, 2), num_stages=2)(1, 2)
    assert last.optimizer == pytest.approx(2 * layer.optimizer + post.optimizer + measured.tied_copy_optimizer)


def test_stage_times_add_groups_and_recomputation(measured) -> None:
    pre, layer, post = (measured.group(g) for g in GROUPS)
    stage_time = stage_time_fn(measured, ComputeInputs(MODEL, 2), num_stages=3)
    assert stage_time(1, 2).forward == pytest.approx(2 * layer.forward)
    assert stage_time(0, 1).backward == pytest.approx(pre.backward + layer.backward)
    assert stage_time(2, 0).forward == pytest.approx(post.forward)
    for s in range(3):
        assert stage_time(s, 3).forward > stage_time(s, 2).forward
    recompute = stage_time_fn(measured, ComputeInputs(MODEL, 2, checkpoint_activations=True), num_stages=3)
    assert recompute(1, 2).backward == pytest.approx(2 * (layer.backward + layer.forward))
    assert recompute(0, 2).backward == pytest.approx(pre.backward + 2 * (layer.backward + layer.forward))
    pairs = stage_time_fn(
        measured, ComputeInputs(MODEL, 2, checkpoint_activations=True, checkpoint_num_layers=2), num_stages=3
    )
    # stage 0's functions in chunks of two: [cast emb] [pos t] [t]: only the last layer is recomputed
    assert pairs(0, 2).backward == pytest.approx(pre.backward + 2 * layer.backward + layer.forward)
