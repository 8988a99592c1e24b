"""The planner and mixture-of-experts models: Megatron-DeepSpeed's MoE flags from the trainer's declarations, the
trainer's own refusals, and what a MoE plan prices and prints."""

from __future__ import annotations

import pytest

from megatron_ds.errors import ConfigError
from megatron_ds.flags import BY_NAME
from megatron_ds.flags.parser import parse_config
from megatron_ds.plan import command_line
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.inputs import resolve

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
