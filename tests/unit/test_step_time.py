"""The step-time model in seconds (`estimate/efficiency.py`, `communication.py`, `layer_time.py`,
`step_time.py`): each term against its formula by hand, the closed form against the replayed schedule,
the lower bound below every prediction, and what the features change."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_ds.config import ModelConfig
from megatron_ds.estimate.communication import INTER_FRACTION, INTRA_FRACTION, Links, Placement
from megatron_ds.estimate.compute import model_flops_per_iteration
from megatron_ds.estimate.devices import find_named
from megatron_ds.estimate.efficiency import MEMORY_FRACTION, Kernels
from megatron_ds.estimate.layer_time import (
    CROSS_ENTROPY_BYTES,
    MEGATRON_CROSS_ENTROPY_BYTES,
    TE_COMM_SMS,
    TE_PIPELINE_SPLITS,
    _overlapped_linear,
    layer_times,
    post_times,
)
from megatron_ds.estimate.run_features import (
    DP_AFTER_BACKWARD,
    DP_OVERLAP_LAST,
    MATH,
    MEGATRON_CORE_H100,
    MEGATRON_LM_2021,
    RunFeatures,
    deepspeed_features,
)
from megatron_ds.estimate.step_bounds import closed_form_step, step_lower_bound
from megatron_ds.estimate.step_inputs import StepInputs
from megatron_ds.estimate.step_simulator import simulate
from megatron_ds.estimate.step_time import ADAM_BYTES_FP32_STATES, SIMULATE_LIMIT, predict_step
from megatron_ds.model.shapes import layer_params

A100 = find_named("A100-80GB")[0]
H100 = find_named("H100-80GB")[0]
KERNELS = Kernels.for_device(A100, "bf16")
LINKS = Links.for_device(A100, 8)


def gpt(layers: int = 8, h: int = 4096, heads: int = 32, s: int = 2048, vocab: int = 51200, **kw) -> ModelConfig:
    return ModelConfig(
        num_layers=layers,
        hidden_size=h,
        num_attention_heads=heads,
        ffn_hidden_size=4 * h,
        seq_length=s,
        max_position_embeddings=s,
        vocab_size=vocab,
        **kw,
    )


def test_a_large_matmul_runs_at_the_devices_ceiling_and_a_skinny_one_at_memory_speed() -> None:
    k = KERNELS
    assert k.matmul_fraction == pytest.approx(271.2 / 312.0)  # the MAMF table's A100 SXM
    m = n = 128 * 108  # exactly one wave of 128 x 128 tiles on 108 SMs
    assert k.wave_efficiency(m, n, 4096) == 1.0
    assert k.matmul(m, n, 4096) == pytest.approx(2 * m * n * 4096 / (312e12 * k.matmul_fraction))
    skinny = k.matmul(8192, 8192, 1)  # 2 flops per output element: bound by writing the output
    assert skinny == pytest.approx(2 * (8192 + 8192 + 8192 * 8192) / (2039e9 * MEMORY_FRACTION))
    # one tile more than a wave: a second, almost empty wave
    assert k.wave_efficiency(128 * 109, 128, 4096) == pytest.approx(109 / 216)


def test_a_measured_profile_replaces_the_tables_figures() -> None:
    k = KERNELS.measured({"matmul_tflops": 156.0, "memory_gbs": 1000.0, "name": "here"})
    assert k.matmul_fraction == pytest.approx(0.5) and k.memory(1e9) == pytest.approx(1e-3)
    assert "measured profile here" in k.source
    assert Kernels.for_device(find_named("P100-16GB")[0], "fp16") is None  # no peak or bandwidth in the table
    rtx = Kernels.for_device(find_named("RTX-4090")[0], "bf16")  # the Ada whitepaper's peak, no measured ceiling
    assert rtx is not None and rtx.peak_flops == 165.2e12 and "assumed matmul ceiling" in rtx.source


def test_collectives_follow_ncclS_ring_formulas_over_the_groups_link() -> None:
    nvlink, network = 300e9 * INTRA_FRACTION, 25e9 * INTER_FRACTION  # A100: NVLink 600 GB/s both ways, HDR
    assert LINKS.bandwidth(True) == pytest.approx(nvlink) and LINKS.bandwidth(False) == pytest.approx(network)
    assert LINKS.all_reduce(8e9, 8, True) == pytest.approx(2 * 7 / 8 * 8e9 / nvlink)
    assert LINKS.reduce_scatter(8e9, 4, False) == pytest.approx(3 / 4 * 8e9 / network)
    assert LINKS.all_reduce(1e9, 1, False) == 0.0 and LINKS.send(1e9, False) == pytest.approx(1e9 / network)
    place = Placement(tp=2, pp=4, dp=4, gpus_per_node=8)
    assert place.tp_within_node and place.dp_within_node and not place.stages_within_node
    assert not Placement(tp=8, pp=2, dp=2, gpus_per_node=8).dp_within_node
    # a group spanning nodes drives the adapters of its ranks in each node (NCCL's channels), up to NVLink's ring
    assert LINKS.bandwidth(False, 4) == pytest.approx(4 * network)
    assert LINKS.bandwidth(False, 8) == pytest.approx(min(8 * network, nvlink))
    assert LINKS.reduce_scatter(8e9, 16, False, 2) == pytest.approx(15 / 16 * 8e9 / (2 * network))
    assert [Placement(t, 2, 48, 8).dp_ranks_per_node for t in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert Placement(1, 1, 4, 8).dp_ranks_per_node == 4  # the whole group in one node
    l40s = Links.for_device(find_named("L40S")[0], 8)  # no NVLink: PCIe Gen4, and no reference network
    assert l40s.intra_node == pytest.approx(32e9) and "assumed 200 Gb/s" in l40s.source


def test_a_layers_backward_is_twice_its_matmuls_and_recomputation_is_its_forward() -> None:
    features = deepspeed_features(1, 2)
    t = layer_times(gpt(), 1, 1, 2, KERNELS, LINKS, features)
    assert t.recompute == t.forward
    assert t.parts["tp-comm"] == 0.0  # one tensor rank
    two = layer_times(gpt(), 1, 2, 2, KERNELS, LINKS, features)
    comm = 2 * LINKS.all_reduce(2048 * 4096 * 2, 2, True)  # two all-reduces of (b s h) per pass
    assert two.parts["tp-comm"] == pytest.approx(2 * comm)
    hidden = layer_times(gpt(), 1, 2, 2, KERNELS, LINKS, dataclasses.replace(features, tp_overlap=True))
    assert hidden.parts["tp-comm"] < two.parts["tp-comm"]
    sp = layer_times(gpt(), 1, 2, 2, KERNELS, LINKS, dataclasses.replace(features, sequence_parallel=True))
    assert sp.parts["memory"] < two.parts["memory"]  # norms and dropout on 1/t of the tokens
    math = layer_times(gpt(), 1, 1, 2, KERNELS, LINKS, dataclasses.replace(features, attention=MATH))
    assert math.parts["attention"] > t.parts["attention"]  # the full score matrix through memory


def test_tp_comm_overlap_cuts_matmuls_as_userbuffers_does_and_shares_the_processors() -> None:
    k, links = Kernels.for_device(H100, "bf16"), Links.for_device(H100, 8)
    n, h, t, w, comm = 4096, 8192, 8, 2, 1e-4
    column = _overlapped_linear(k, n, h, 3 * h // t, w, t, column=True, comm=comm)
    share = TE_COMM_SMS / 132  # H100 SXM: 132 processors, 16 of them on the bulk communication
    assert column.forward == pytest.approx(t * k.matmul(n // t, 3 * h // t, h))  # ring exchange: 1/t rows at a time
    assert column.input_grad == pytest.approx(k.matmul(n, h, 3 * h // t) + share * comm)
    assert column.weight_grad == pytest.approx(k.matmul(h, 3 * h // t, n) + share * comm)
    row = _overlapped_linear(k, n, 4 * h // t, h, w, t, column=False, comm=1.0)  # a comm longer than the matmul
    chunked = TE_PIPELINE_SPLITS * k.matmul(n // TE_PIPELINE_SPLITS, h, 4 * h // t)
    assert row.forward == pytest.approx(chunked * (1 + share))  # the whole matmul beside the reduce-scatter
    assert row.input_grad == pytest.approx(t * k.matmul(n // t, 4 * h // t, h))
    assert row.weight_grad == pytest.approx(k.matmul(4 * h // t, h, n))
    assert t * k.matmul(n // t, 3 * h // t, h) > k.matmul(n, 3 * h // t, h)  # 4 x 24 tiles: under one wave
    model = gpt(h=h, heads=64, s=n)
    plain = dataclasses.replace(MEGATRON_CORE_H100, tp_overlap=False)
    over = layer_times(model, 1, t, w, k, links, MEGATRON_CORE_H100)
    assert over.parts["matmul"] > layer_times(model, 1, t, w, k, links, plain).parts["matmul"]
    assert over.parts["tp-comm"] < layer_times(model, 1, t, w, k, links, plain).parts["tp-comm"]
    no_sms = dataclasses.replace(k, compute_units=None)  # no processor count: chunking only
    assert _overlapped_linear(no_sms, n, h, h, w, t, True, comm).input_grad == no_sms.matmul(n, h, h)


def test_megatrons_loss_moves_its_fp32_logits_through_memory_op_by_op() -> None:
    model, w = gpt(vocab=131072), 2
    ours = post_times(model, 1, 1, w, KERNELS, LINKS, deepspeed_features(1, w))
    megatron = post_times(model, 1, 1, w, KERNELS, LINKS, MEGATRON_CORE_H100)
    logits = 2048 * 131072
    extra = sum(MEGATRON_CROSS_ENTROPY_BYTES) + 2 * w - sum(CROSS_ENTROPY_BYTES)
    assert megatron.parts["memory"] - ours.parts["memory"] == pytest.approx(KERNELS.memory(extra * logits))
    assert MEGATRON_CROSS_ENTROPY_BYTES[0] + w == 38 and MEGATRON_CROSS_ENTROPY_BYTES[1] + w == 14


def inputs(model: ModelConfig, pp: int, m: int, dp: int = 1, tp: int = 1, zero: int = 1, **kw) -> StepInputs:
    per = model.num_layers // pp
    params = layer_params(model, tp).total * per
    return StepInputs(
        model=model,
        layers_per_stage=(per,) * pp,
        stage_params=(params,) * pp,
        micro_batch_size=1,
        num_micro_batches=m,
        tp=tp,
        dp=dp,
        precision="bf16",
        zero_stage=zero,
        checkpoint_activations=kw.pop("ckpt", False),
        gpus_per_node=8,
        **kw,
    )


def test_one_stage_one_micro_batch_is_the_sum_of_its_terms() -> None:
    features = deepspeed_features(0, 2)
    step = predict_step(inputs(gpt(), 1, 1, dp=8, zero=0), KERNELS, LINKS, features)
    params = layer_params(gpt()).total * 8
    reduce = LINKS.all_reduce(params * 2, 8, True)  # ZeRO-0: an all-reduce of the 16-bit gradients
    adam = KERNELS.memory(params * (ADAM_BYTES_FP32_STATES + 2) + params * 4)
    assert step.reduce_grads[0] == pytest.approx(reduce) and step.optimizer[0] == pytest.approx(adam)
    assert step.seconds == pytest.approx(step.forward[0] + step.backward[0] + reduce + adam)
    assert step.tflops_per_gpu == pytest.approx(model_flops_per_iteration(gpt(), 8) / step.seconds / 8 / 1e12)
    assert step.mfu == pytest.approx(step.tflops_per_gpu / 312.0)
    assert step.tokens_per_second == pytest.approx(8 * 2048 / step.seconds)


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 4), (3, 5), (4, 3), (4, 8), (8, 2), (8, 16), (16, 40)])
def test_the_closed_form_is_the_replayed_1f1b_for_equal_stages(pp: int, m: int) -> None:
    fwd, bwd = [1.0] * pp, [2.0] * pp
    replay = simulate(m, fwd, bwd, [0.5] * pp, send=0.01, tied_reduce=0.2, reduce_grads=[0.3] * pp).step_time
    closed = closed_form_step(m, fwd, bwd, [0.5] * pp, [0.3] * pp, 0.01, 0.2)
    assert closed == pytest.approx(replay, rel=1e-9)
    uneven = [1.0 + 0.1 * s for s in range(pp)]  # unequal stages: an approximation, close
    replay = simulate(m, uneven, bwd, [0.5] * pp, send=0.01, reduce_grads=[0.3] * pp).step_time
    assert closed_form_step(m, uneven, bwd, [0.5] * pp, [0.3] * pp, 0.01, 0.0) == pytest.approx(replay, rel=0.05)


def test_the_lower_bound_is_below_every_prediction_and_large_pipelines_use_the_closed_form() -> None:
    features = deepspeed_features(1, 2)
    for pp, m, ckpt in ((1, 4, False), (2, 8, True), (4, 16, False), (8, 64, True)):
        inp = inputs(gpt(layers=16), pp, m, dp=2, ckpt=ckpt)
        step = predict_step(inp, KERNELS, LINKS, features)
        bound = step_lower_bound(inp.model, 1, m, 1, pp, "bf16", ckpt, KERNELS, LINKS, features)
        assert bound <= step.seconds * (1 + 1e-9)
        assert step.simulated == (m * pp <= SIMULATE_LIMIT)
    big = predict_step(inputs(gpt(layers=64), 64, 128), KERNELS, LINKS, features)
    assert not big.simulated and big.seconds > 128 * max(f + b for f, b in zip(big.forward, big.backward))


def test_what_overlap_hides_and_what_zero3_costs() -> None:
    model = gpt()
    after = predict_step(inputs(model, 1, 4, dp=16), KERNELS, LINKS, RunFeatures("a", dp_mode=DP_AFTER_BACKWARD))
    last = predict_step(inputs(model, 1, 4, dp=16), KERNELS, LINKS, RunFeatures("b", dp_mode=DP_OVERLAP_LAST))
    assert last.seconds < after.seconds and last.reduce_grads[0] < after.reduce_grads[0]
    z1 = predict_step(inputs(model, 1, 4, dp=16, zero=1), KERNELS, LINKS, deepspeed_features(1, 2))
    z3 = predict_step(inputs(model, 1, 4, dp=16, zero=3), KERNELS, LINKS, deepspeed_features(3, 2))
    assert z3.seconds > z1.seconds and z3.dp_per_micro_batch[0] > 0  # gathers every forward and backward
    recompute = predict_step(inputs(model, 1, 4, dp=16, ckpt=True), KERNELS, LINKS, deepspeed_features(1, 2))
    assert recompute.hardware_flops > recompute.model_flops and recompute.seconds > z1.seconds


def test_hopper_with_megatron_core_features_prices_flash_attention_at_the_papers_share() -> None:
    k = Kernels.for_device(H100, "bf16")
    assert k.attention_forward == pytest.approx(0.62) and k.attention_backward == pytest.approx(0.47)
    step = predict_step(
        inputs(gpt(h=8192, heads=64, s=4096), 2, 8, dp=4, tp=8), k, Links.for_device(H100, 8), MEGATRON_CORE_H100
    )
    assert step.send > 0.0 and 0.2 < step.mfu < 0.8  # 1F1B: blocking sends; a plausible share of the peak


def test_sends_are_blocking_outside_interleaving_and_scatter_gather_pays_the_nodes_all_gather() -> None:
    model, links = gpt(h=8192, heads=64), Links.for_device(A100, 8)
    activation = 2048 * 8192 * 2  # b s h at 2 bytes; stages of 8 x 4 ranks sit on different nodes
    old = predict_step(inputs(model, 2, 8, dp=4, tp=8), KERNELS, links, MEGATRON_LM_2021)
    gather = links.reduce_scatter(activation, 8, within_node=True)  # the receiver's all-gather
    assert old.send == pytest.approx(links.send(activation / 8, within_node=False) + gather)
    core = predict_step(inputs(model, 2, 8, dp=4, tp=8), KERNELS, links, MEGATRON_CORE_H100)
    assert core.send == pytest.approx(links.send(activation / 8, within_node=False))  # SP: the shard, no gather
    chunks = dataclasses.replace(
        inputs(model, 2, 8, dp=4, tp=8, schedule="interleaved", virtual_stages=2), layers_per_stage=(2,) * 4
    )
    assert predict_step(chunks, KERNELS, links, MEGATRON_CORE_H100).send == 0.0  # overlap_p2p_comm


def test_delayed_grad_reduce_overlaps_only_the_first_stages_last_backward() -> None:
    inp = inputs(gpt(), 2, 8, dp=16)
    eager = predict_step(inp, KERNELS, LINKS, RunFeatures("e", dp_mode=DP_OVERLAP_LAST))
    delayed = predict_step(inp, KERNELS, LINKS, RunFeatures("d", dp_mode=DP_OVERLAP_LAST, delay_grad_reduce=True))
    params, place = inp.stage_params[1], Placement(1, 2, 16, 8)
    reduce = LINKS.reduce_scatter(params * 2, 16, place.dp_within_node, place.dp_ranks_per_node)
    gather = LINKS.reduce_scatter(params * 2, 16, place.dp_within_node, place.dp_ranks_per_node)
    assert delayed.reduce_grads[0] == pytest.approx(eager.reduce_grads[0])
    assert delayed.reduce_grads[1] == pytest.approx(reduce + max(0.0, gather - delayed.forward[1]))
    assert delayed.reduce_grads[1] > eager.reduce_grads[1]


def test_a_sliding_window_prices_the_scores_each_software_computes() -> None:
    """A Mistral-like window of 4096 at s = 32768: a windowed flash kernel (megatron-core with Transformer Engine)
    computes the band, pretrain_gpt.py's query chunks the band and at most 1/8 more, a masked square all of it; a
    layer attending fully (half of them with --window-attn-skip-freq 2) weighs in as the mean layer."""
    full = gpt(layers=2, s=32768)
    windowed = dataclasses.replace(full, window_size=(4095, 0))
    half = dataclasses.replace(windowed, window_attn_skip_freq=(1, 0))
    ours = deepspeed_features(1, 2)
    attention = {
        (name, features.window_kernel): layer_times(model, 1, 1, 2, KERNELS, LINKS, features).parts["attention"]
        for name, model in (("full", full), ("window", windowed), ("half", half))
        for features in (ours, MEGATRON_CORE_H100, dataclasses.replace(ours, attention=MATH, window_kernel="masked"))
    }
    s, w = 32768, 4096
    band = (w * (w + 1) // 2 + (s - w) * w) / (s * (s + 1) // 2)  # the band over the causal triangle
    assert attention["window", "band"] == pytest.approx(band * attention["full", "band"])
    assert band < attention["window", "chunks"] / attention["full", "chunks"] <= 1.13 * band
    assert attention["window", "masked"] == attention["full", "masked"]
    for kind in ("band", "chunks"):
        assert attention["half", kind] == pytest.approx((attention["full", kind] + attention["window", kind]) / 2)
