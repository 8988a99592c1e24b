"""The planner and mixture-of-experts models: Megatron-DeepSpeed's MoE flags from the trainer's declarations, the
trainer's own refusals, and what a MoE plan prices and prints."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ds.config import RegularizationConfig
from megatron_ds.errors import ConfigError
from megatron_ds.estimate import activation_memory as act
from megatron_ds.estimate import moe_costs
from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.memory_model import spec_memory, stage_memory_for
from megatron_ds.flags import BY_NAME
from megatron_ds.flags.parser import parse_config
from megatron_ds.model.gpt_pipe import build_layer_specs
from megatron_ds.plan import command_line
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.inputs import resolve
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
        ("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 2"),
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
     {"moe_min_capacity": 0, "moe_train_capacity_factor": 2.0}, {"moe_min_capacity": 20}],
    ids=["top1", "top2", "residual", "swiglu", "factor2", "min-capacity"],
)  # fmt: skip
@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_a_moe_layers_saved_activations_are_what_its_autograd_graph_keeps(
    variant: dict, precision: str, dtype: torch.dtype
) -> None:
    """DeepSpeed's MoE layer as built (sparse dispatch, capacity slots, gate in fp32) on CPU: the bytes the graph of
    the layer's output and load-balancing loss keeps equal the memory model's terms for that layer."""
    m, b = dataclasses.replace(TINY_MOE, **variant), 3
    reg = RegularizationConfig(hidden_dropout=0.0, attention_dropout=0.0)
    layer = build_layer_specs(m, reg, 1234)[4].build().to(dtype).train()
    x = torch.randn(b, m.seq_length, m.hidden_size, dtype=dtype, requires_grad=True)
    out = layer(x)
    measured = graph_bytes(out.sum() + layer.l_aux, layer.parameters())
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
