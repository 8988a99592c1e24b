"""The planner and mixture-of-experts models: Megatron-DeepSpeed's MoE flags from the trainer's declarations, the
trainer's own refusals, and what a MoE plan prices and prints."""

from __future__ import annotations

import dataclasses
import shlex

import pytest
import torch

from megatron_ds.config import RegularizationConfig
from megatron_ds.errors import ConfigError
from megatron_ds.estimate import activation_memory as act
from megatron_ds.estimate import moe_costs
from megatron_ds.estimate.communication import Links
from megatron_ds.estimate.compute import model_flops_per_iteration
from megatron_ds.estimate.devices import find_device
from megatron_ds.estimate.efficiency import Kernels
from megatron_ds.estimate.layer_time import layer_times
from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.memory_model import stage_memory_for
from megatron_ds.estimate.run_features import deepspeed_features
from megatron_ds.estimate.spec_memory import spec_memory
from megatron_ds.estimate.step_inputs import StepInputs, StepTime
from megatron_ds.estimate.step_time import predict_step
from megatron_ds.flags import BY_NAME
from megatron_ds.flags.parser import parse_config
from megatron_ds.model import shapes
from megatron_ds.model.gpt_pipe import build_layer_specs
from megatron_ds.plan import command_line, ds_json
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.inputs import resolve
from megatron_ds.plan.zero_options import choose_all
from megatron_ds.testing.saved_tensors import graph_bytes
from megatron_ds.testing.scenario import tiny_config

SIZES = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128"]
SIZES += ["--vocab-size", "1024"]
TRAINER = "--lr 1e-3 --train-iters 2 --mock-data --micro-batch-size 1 --global-batch-size 8".split()


def planned(*argv: str):
    return resolve(command_line.parse(["memory", *SIZES, *argv])[1])


def test_the_moe_flags_are_the_trainers_declarations_and_reach_the_model() -> None:
    parser = command_line.build_parser()
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for name in (*command_line.MOE_ARCHITECTURE_FLAGS, "--moe-expert-parallel-size", "--create-moe-param-group"):
        flag = BY_NAME[name]
        assert actions[name].help.startswith(flag.help.replace("%", "%%")), name
        if not flag.is_switch:
            assert actions[name].type is flag.type and actions[name].nargs == flag.nargs, name
    res = planned(*"--num-experts 4 8 --expert-interval 2 --mlp-type residual --topk 2".split(),
                  *"--moe-train-capacity-factor 1.5 --moe-min-capacity 2 --disable-moe-token-dropping".split(),
                  *"--moe-loss-coeff 0.01 --num-gpus 8".split())  # fmt: skip
    model = res.model()
    assert model.experts_per_layer == (1, 4, 1, 8) and model.mlp_type == "residual" and model.moe_top_k == 2
    assert model.moe_train_capacity_factor == 1.5 and model.moe_min_capacity == 2 and not model.moe_token_dropping
    assert model.moe_loss_coeff == 0.01
    trainer = parse_config([*SIZES, *res.dims["architecture"], *TRAINER], world_size=8)[0].model
    assert trainer == model  # the printed architecture flags build the same model in pretrain_gpt.py


@pytest.mark.parametrize(
    "argv,trainer",
    [
        (
            "--pipeline-model-parallel-size 2 --checkpoint-activations",
            "--pipeline-model-parallel-size 2 --checkpoint-activations",
        ),
        ("--pipeline-model-parallel-size 2 --pp-schedule zbh1", "--pipeline-model-parallel-size 2 --pp-schedule zbh1"),
        ("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 2"),
        ("--zero-stage 3", "--zero-stage 3"),
        ("--moe-expert-parallel-size 3", "--moe-expert-parallel-size 3"),  # divides neither 8 GPUs nor 4 experts
        ("--moe-expert-parallel-size 8", "--moe-expert-parallel-size 8"),  # divides the GPUs, not the 4 experts
    ],
)
def test_what_the_trainer_refuses_is_refused_with_its_own_line(argv: str, trainer: str) -> None:
    with pytest.raises(PlanError) as err:
        planned("--num-experts", "4", "--num-gpus", "8", *argv.split())
    with pytest.raises(ConfigError) as expected:
        parse_config([*SIZES, "--num-experts", "4", *TRAINER, "--create-moe-param-group", *trainer.split()], 8)
    assert str(err.value) == str(expected.value) and "\n" not in str(err.value)


# --- memory: what DeepSpeed's MoE layer saves, and the one stage's sums ---------------------------------------------

TINY_MOE = dataclasses.replace(tiny_config().model, num_experts=(4,))  # layers 2 and 4 have 4 experts
WIDE_MOE = dataclasses.replace(
    TINY_MOE,
    hidden_size=1024,
    num_attention_heads=8,
    ffn_hidden_size=4096,
    seq_length=1024,
    max_position_embeddings=1024,
)
"""Wide enough that the all-to-alls and the reductions are not lost in rounding."""


def test_capacity_is_deepspeeds() -> None:
    # sharded_moe._capacity: ceil(tokens / experts x factor), x 2 for top-2, at least the minimum
    assert moe_costs.capacity(TINY_MOE, 48, 4) == 12
    assert moe_costs.capacity(dataclasses.replace(TINY_MOE, moe_top_k=2), 48, 4) == 24
    assert moe_costs.capacity(dataclasses.replace(TINY_MOE, moe_train_capacity_factor=1.1), 48, 4) == 14
    assert moe_costs.capacity(TINY_MOE, 8, 4) == 4  # --moe-min-capacity 4
    assert moe_costs.capacity(dataclasses.replace(TINY_MOE, moe_token_dropping=False, moe_top_k=2), 48, 4) == 24


@pytest.mark.parametrize(
    "variant",
    [{}, {"moe_top_k": 2}, {"mlp_type": "residual"}, {"activation": "swiglu", "add_bias_linear": False},
     {"moe_min_capacity": 0, "moe_train_capacity_factor": 2.0}, {"moe_min_capacity": 20},
     {"moe_router": "megatron", "moe_top_k": 1}, {"moe_router": "megatron", "moe_top_k": 2},
     {"moe_router": "megatron", "moe_top_k": 3},
     {"moe_router": "megatron", "moe_top_k": 2, "moe_router_pre_softmax": True},
     {"moe_router": "megatron", "moe_top_k": 2, "activation": "swiglu", "add_bias_linear": False,
      "moe_shared_expert_size": 24, "moe_shared_expert_gate": True},
     {"moe_router": "megatron", "moe_top_k": 2, "add_bias_linear": False, "moe_shared_expert_size": 40}],
    ids=["top1", "top2", "residual", "swiglu", "factor2", "min-capacity", "megatron1", "megatron2", "megatron3",
         "pre-softmax2", "shared-gated-swiglu", "shared-gelu"],
)  # fmt: skip
@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_a_moe_layers_saved_activations_are_what_its_autograd_graph_keeps(
    variant: dict, precision: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed's MoE layer as built (sparse dispatch, capacity slots, gate in fp32) on CPU: the bytes the graph of
    the layer's output and load-balancing loss keeps equal the memory model's terms for that layer. Without token
    dropping (Megatron-LM's router) the capacity is the most tokens an expert got, which the model plans as the
    balanced share: here it is given the capacity the batch had."""
    m, b = dataclasses.replace(TINY_MOE, **variant), 3
    reg = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0)
    layer = build_layer_specs(m, reg, 1234)[4].build().to(dtype).train()
    x = torch.randn(b, m.seq_length, m.hidden_size, dtype=dtype, requires_grad=True)
    out = layer(x)
    measured = graph_bytes(out.sum() + layer.l_aux, layer.parameters())
    if not m.moe_token_dropping:
        slots = int(layer.moe.deepspeed_moe.exp_counts.max())
        monkeypatch.setattr(moe_costs, "capacity", lambda *_: slots)
    inputs = MemoryInputs(m, b, 1, precision=precision, device="cpu", regularization=reg)
    specs = [s for s in spec_memory(inputs) if s.group == "body"]
    assert specs[1].activations == measured
    assert specs[0].activations == sum(act.transformer_layer_terms(m, b, inputs.kernels, regularization=reg).values())


def test_the_one_stage_holds_every_layers_parameters_states_and_activations() -> None:
    m = dataclasses.replace(TINY_MOE, num_experts=(2, 4))
    inputs = MemoryInputs(m, 2, 2, precision="bf16", zero_stage=1, data_parallel_size=4, expert_parallel_size=2)
    specs = spec_memory(inputs)
    stage = stage_memory_for(inputs, 0, 1, m.num_layers)
    held = [s for s in specs if not s.tied]  # one stage: the tied head is the embedding
    assert stage.num_params == pytest.approx(sum(s.num_params for s in held))
    for attr in ("params", "grads", "optimizer"):
        assert getattr(stage, attr) == pytest.approx(sum(getattr(s, attr) for s in held)), attr
    assert stage.activation_per_micro_batch == pytest.approx(sum(s.activations for s in held))


# --- FLOPs and step time ----------------------------------------------------------------------------------------


def _megatron_deepspeed_flops(m, batch: int) -> int:
    """Megatron-DeepSpeed 4efb479's throughput_calculator (megatron/utils.py) without recomputation, MHA, GeLU."""
    s, h, layers, v = m.seq_length, m.hidden_size, m.num_layers, m.vocab_size
    macs = batch * layers * 4 * h * h * s + batch * layers * 2 * h * s * s
    macs += batch * layers * 2 * m.ffn_hidden_size * h * s * m.moe_top_k + batch * v * h * s
    return 3 * 2 * macs


@pytest.mark.parametrize("top_k", [1, 2])
def test_model_flops_count_the_active_experts_and_the_gate(top_k: int) -> None:
    """Every layer with experts (--expert-interval 1): Megatron-DeepSpeed's count (--topk x the MLP) plus the gate's
    three h x E matmuls per token; the empty capacity slots are not model FLOPs."""
    m = dataclasses.replace(TINY_MOE, expert_interval=1, moe_top_k=top_k, moe_train_capacity_factor=2.0)
    gate = 3 * 2 * m.seq_length * m.hidden_size * 4 * m.num_layers
    assert model_flops_per_iteration(m, 8) == 8 * gate + _megatron_deepspeed_flops(m, 8)
    dense = dataclasses.replace(m, num_experts=(1,))
    assert model_flops_per_iteration(dense, 8) == _megatron_deepspeed_flops(dataclasses.replace(dense, moe_top_k=1), 8)


def test_the_experts_compute_every_capacity_slot() -> None:
    m = dataclasses.replace(TINY_MOE, moe_train_capacity_factor=2.0, moe_min_capacity=0)
    b, s_tok, h, f = 3, 3 * m.seq_length, m.hidden_size, m.ffn_hidden_size
    runs = moe_costs.mlp_flops(m, b, 4)
    assert runs["expert fc1"] == 2 * (4 * 24) * h * f == 2 * runs["expert fc2"] // 2  # E x C = 4 x 24 = 2 x tokens
    assert moe_costs.mlp_flops(m, b, 4, active=True)["expert fc1"] == 2 * s_tok * h * f
    assert runs["gate"] == 2 * s_tok * h * 4


def test_the_shared_expert_runs_over_every_token_in_both_counts() -> None:
    """Megatron-LM's shared expert (SwiGLU, width 24, gated): fc1 h -> 2 x 24, fc2 24 -> h and the gate h -> 1 over
    every token, in what runs and in the model FLOPs alike."""
    m = dataclasses.replace(TINY_MOE, moe_router="megatron", moe_top_k=2, activation="swiglu", add_bias_linear=False,
                            moe_shared_expert_size=24, moe_shared_expert_gate=True)  # fmt: skip
    s_tok, h = 3 * m.seq_length, m.hidden_size
    shared = {"shared expert fc1": 2 * s_tok * h * 48, "shared expert fc2": 2 * s_tok * 24 * h,
              "shared expert gate": 2 * s_tok * h}  # fmt: skip
    for active in (False, True):
        flops = moe_costs.mlp_flops(m, 3, 4, active=active)
        assert {k: v for k, v in flops.items() if k.startswith("shared")} == shared
    assert not [k for k in moe_costs.mlp_flops(TINY_MOE, 3, 4) if k.startswith("shared")]


def test_each_pass_of_a_moe_layer_runs_two_all_to_alls_over_the_expert_parallel_group() -> None:
    m = WIDE_MOE
    kernels, links = Kernels.for_device(find_device("H100-SXM"), "bf16"), Links.for_device(find_device("H100-SXM"), 8)
    run = deepspeed_features(0, 2)
    one = links.all_to_all(moe_costs.all_to_all_bytes(m, 2, 4, 2), 4, True)
    assert one == pytest.approx(3 / 4 * 4 * moe_costs.capacity(m, 2048, 4) * 1024 * 2 / links.bandwidth(True))
    ep1 = layer_times(m, 2, 1, 2, kernels, links, run, num_experts=4, all_to_all=(1, True))
    ep4 = layer_times(m, 2, 1, 2, kernels, links, run, num_experts=4, all_to_all=(4, True))
    assert ep1.parts["all-to-all"] == 0 and ep4.parts["all-to-all"] == pytest.approx(4 * one)
    across = layer_times(m, 2, 1, 2, kernels, links, run, num_experts=4, all_to_all=(4, False))
    far = links.all_to_all(moe_costs.all_to_all_bytes(m, 2, 4, 2), 4, False)  # the group leaves the node
    assert far > one and across.parts["all-to-all"] == pytest.approx(4 * far)
    assert across.forward - ep4.forward == pytest.approx(2 * (far - one))  # two in the forward, the same matmuls
    assert across.backward - ep4.backward == pytest.approx(2 * (far - one))


def test_the_experts_gradients_are_reduced_over_the_expert_data_parallel_group() -> None:
    m = WIDE_MOE
    device = find_device("H100-SXM")
    kernels, links, run = Kernels.for_device(device, "bf16"), Links.for_device(device, 8), deepspeed_features(1, 2)

    def step(ep: int, experts: int) -> StepTime:
        inp = StepInputs(
            m, (4,), (10**9,), 1, 4, 1, 16, "bf16", 1, False, 8, expert_parallel_size=ep,
            stage_expert_params=(experts,) if experts else (),
        )  # fmt: skip
        return predict_step(inp, kernels, links, run)

    # half the parameters are experts: their reduce-scatter runs over 4 ranks, 4 apart (two per node), not 16
    dense, moe = step(4, 0), step(4, 5 * 10**8)
    assert moe.reduce_grads[0] != dense.reduce_grads[0] and moe.optimizer[0] > dense.optimizer[0]
    assert step(1, 0).optimizer == dense.optimizer  # without expert parameters E changes no optimizer step


# --- the search and its command ------------------------------------------------------------------------------------


def test_a_moe_plan_is_t_p_1_with_an_expert_parallel_size_dividing_experts_and_gpus_and_its_command_trains() -> None:
    _, given, _ = command_line.parse(
        ["--model", "1.3b", "--num-gpus", "16", "--gpu", "A100-80GB", "--num-experts", "8"]
    )
    res = resolve(given)
    choice = choose_all(res, "bf16")
    top = choice.candidate
    assert (top.tp, top.pp, top.dp) == (1, 1, 16) and top.zero_stage in (0, 1, 2) and top.engine == "plain"
    assert 8 % top.expert_parallel_size == 0 and top.time is not None and top.time.parts["all-to-all"] >= 0
    assert all(c.tp == c.pp == 1 and c.zero_stage < 3 and c.offload_optimizer == "none" for c in choice.ranked)
    assert choice.runner_up is not None
    config = ds_json.plan_config(res, top)
    text = ds_json.command_line(res, config)
    flags = shlex.split(text.split("pretrain_gpt.py", 1)[1].replace("\\\n", " "))
    parsed = parse_config(flags, world_size=16)[0]  # the trainer's own parser and checks accept it
    assert parsed.model == res.model() and parsed.parallel.expert_parallel_size == top.expert_parallel_size
    assert parsed.training.zero_stage == top.zero_stage and parsed.engine_kind == "plain"


def test_a_moe_plan_at_a_fixed_pipeline_size_runs_on_the_pipeline_engine_and_its_command_trains() -> None:
    """--pipeline-model-parallel-size 2 with experts: the plan keeps p = 2 (DeepSpeed's pipeline engine: ZeRO 0/1,
    1F1B, no full recomputation, E dividing a stage's 8 data-parallel ranks), each stage's memory counts its own
    layers' experts, and pretrain_gpt.py's parser accepts the printed command (before, a MoE plan was t = p = 1
    whatever the flag said)."""
    argv = ["--model", "1.3b", "--num-gpus", "16", "--gpu", "A100-80GB", "--num-experts", "8"]
    res = resolve(command_line.parse([*argv, "--pipeline-model-parallel-size", "2"])[1])
    choice = choose_all(res, "bf16")
    top = choice.candidate
    assert (top.tp, top.pp, top.dp) == (1, 2, 8) and top.engine == "pipeline" and top.zero_stage in (0, 1)
    assert all(c.pp == 2 and c.zero_stage < 2 and c.recompute != "full" for c in choice.ranked)
    assert all(c.schedule.name == "1f1b" and 8 % c.expert_parallel_size == 0 for c in choice.ranked)
    specs = shapes.gpt_spec_params(res.model(), 1, top.expert_parallel_size)
    held = [specs[lo:hi] for lo, hi in zip(top.layout.parts, top.layout.parts[1:])]
    moe_layers = [sum(1 for s in stage if s.expert_params) for stage in held]
    layers = list(top.layout.layers_per_stage)
    assert moe_layers[0] * sum(layers) != sum(moe_layers) * layers[0]  # not the model's share: the mean would miss
    assert [s.num_params for s in top.stages] == [sum(s.num_params for s in stage) for stage in held]
    config = ds_json.plan_config(res, top)
    text = ds_json.command_line(res, config)
    flags = shlex.split(text.split("pretrain_gpt.py", 1)[1].replace("\\\n", " "))
    parsed = parse_config(flags, world_size=16)[0]
    assert parsed.engine_kind == "pipeline" and parsed.parallel.pipeline_model_parallel_size == 2


def test_a_fixed_expert_parallel_size_and_zero_stage_are_kept() -> None:
    argv = ["--model", "1.3b", "--num-gpus", "16", "--gpu", "A100-80GB", "--num-experts", "8"]
    argv += ["--moe-expert-parallel-size", "2", "--zero-stage", "1"]
    choice = choose_all(resolve(command_line.parse(argv)[1]), "bf16")
    assert {(c.expert_parallel_size, c.zero_stage) for c in choice.ranked} == {(2, 1)}


# --- the `zero` section's table ---------------------------------------------------------------------------------------


def _zero_section(*argv: str):
    from megatron_ds.plan.context import Context
    from megatron_ds.plan.zero import zero_section

    res = planned("--num-gpus", "8", "--gpus-per-node", "8", "--gpu", "A100-80GB", *argv)
    return zero_section(Context(res, "bf16", "")), res


@pytest.mark.parametrize("ep", [2, 4])
def test_the_zero_table_holds_experts_over_e_and_their_states_over_d_over_e(ep: int) -> None:
    from megatron_ds.estimate.model_states import state_factors
    from megatron_ds.model import shapes

    sec, res = _zero_section("--num-experts", "4", "--moe-expert-parallel-size", str(ep))
    m, d = res.model(), 8
    experts_at = {e: sum(p.expert_params for p in shapes.gpt_spec_params(m, 1, e)) for e in (1, ep)}
    assert experts_at[ep] * ep == experts_at[1] > 0 and sec.data["expert_parallel_size"] == ep
    by_label = {r["label"]: r for r in sec.data["rows"]}
    for stage in (0, 1, 2):
        row = by_label[f"ZeRO-{stage}"]
        at = {
            e: stage_memory_for(
                MemoryInputs(m, 1, 1, precision="bf16", zero_stage=stage, data_parallel_size=d, expert_parallel_size=e),
                0, 1, m.num_layers,
            ).model_states
            for e in (1, ep)
        }  # fmt: skip
        assert row["gpu_states"] == pytest.approx(at[ep], rel=1e-12)
        # only the experts' share moved: experts / E of them per rank, their states partitioned over d / E ranks
        f = state_factors("bf16", stage)
        moved = f.per_param(d // ep) * experts_at[ep] - f.per_param(d) * experts_at[1]
        assert row["gpu_states"] - at[1] == pytest.approx(moved, rel=1e-9) and moved < 0
        assert row["deepspeed_gpu"] is None and row["engine"] == "plain, P = 1"  # its estimators know no experts
    text = "\n".join(sec.lines)
    assert "expert-parallel size 1" not in text and f"E = {ep} (--moe-expert-parallel-size)" in text


def test_the_zero_tables_zero3_rows_are_refused_in_the_trainers_words() -> None:
    sec, res = _zero_section("--num-experts", "4", "--moe-expert-parallel-size", "2")
    stage3 = [r for r in sec.data["rows"] if r["stage"] == 3]
    assert len(stage3) == 4 and all(r["gpu_states"] is None and not r["fits"] for r in stage3)
    with pytest.raises(ConfigError) as err:  # the trainer's own check of the same configuration
        parse_config([*SIZES, *res.dims["architecture"], *TRAINER, "--zero-stage", "3",
                      "--moe-expert-parallel-size", "2"], world_size=8)  # fmt: skip
    assert all(r["refused"] == str(err.value) for r in stage3)
    lines = [line for line in sec.lines if line.startswith("  ZeRO-3 ")]
    assert len(lines) == 4 and all("refused" in line and "GiB" not in line for line in lines)
    assert any(str(err.value) in line for line in sec.lines)


def test_a_moe_model_that_does_not_fit_asks_for_gpus_not_for_parallelism_the_trainer_refuses() -> None:
    """The trainer runs experts at t = p = 1: the fix is more GPUs (a larger E) or larger ones."""
    argv = ["--model", "1.3b", "--num-gpus", "2", "--gpu", "V100-16GB", "--num-experts", "128"]
    with pytest.raises(PlanError, match="does not fit") as caught:
        choose_all(resolve(command_line.parse(argv)[1]), "fp16")
    assert "--moe-expert-parallel-size" in str(caught.value) and "pipeline/tensor" not in str(caught.value)


def test_megatron_lms_moe_flags_plan_and_the_command_keeps_its_router() -> None:
    """The MoE flags of Megatron-LM's Mixtral line (its router's, its kernels' no-ops, --expert-model-parallel-size as
    the fixed expert-parallel size): the planner's model is Megatron-LM's router, and pretrain_gpt.py's parser takes the
    printed command to the same model and size."""
    moe = (
        "--num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type "
    )
    moe += "alltoall --expert-model-parallel-size 2 --disable-bias-linear"
    moe += (
        " --moe-router-pre-softmax --moe-shared-expert-intermediate-size 2048 --moe-shared-expert-gate"  # Qwen2-MoE's
    )
    res = resolve(command_line.parse(["--model", "1.3b", "--num-gpus", "16", "--gpu", "A100-80GB", *moe.split()])[1])
    assert (res.model().moe_router, res.model().moe_top_k, res.model().moe_loss_coeff) == ("megatron", 2, 0.01)
    m = res.model()
    assert (m.moe_router_pre_softmax, m.moe_shared_expert_size, m.moe_shared_expert_gate) == (True, 2048, True)
    top = choose_all(res, "bf16").candidate
    assert top.expert_parallel_size == 2
    text = ds_json.command_line(res, ds_json.plan_config(res, top))
    flags = shlex.split(text.split("pretrain_gpt.py", 1)[1].replace("\\\n", " "))
    parsed = parse_config(flags, world_size=16)[0]
    assert parsed.model == res.model() and parsed.parallel.expert_parallel_size == 2
    with pytest.raises(PlanError, match="--expert-model-parallel-size 2 with --moe-expert-parallel-size 4: the same"):
        command_line.parse([*moe.split(), "--moe-expert-parallel-size", "4"])
