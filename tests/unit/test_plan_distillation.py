"""The planner and knowledge distillation (`--kd`, `--mos`): the teacher sized from its checkpoint or flags by the
trainer's own checks, its weights and the kd loss's saved tensors (against the autograd graph on CPU), its forward in
the step, the search at pipeline size 1 and a printed command the trainer parses."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch

from megatron_ds.config import Config, DistillationConfig
from megatron_ds.errors import ConfigError, UserError
from megatron_ds.estimate import distillation_costs, moe_costs
from megatron_ds.estimate.communication import Links
from megatron_ds.estimate.compute import model_flops_per_iteration
from megatron_ds.estimate.devices import find_device
from megatron_ds.estimate.efficiency import Kernels
from megatron_ds.estimate.layer_time import layer_times
from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.memory_model import stage_memory_for
from megatron_ds.estimate.run_features import deepspeed_features
from megatron_ds.estimate.spec_memory import spec_memory
from megatron_ds.estimate.step_inputs import StepInputs
from megatron_ds.estimate.step_time import predict_step
from megatron_ds.flags.parser import parse_config
from megatron_ds.model import naming
from megatron_ds.model.distillation import kd_loss, vocab_parallel_kd_loss
from megatron_ds.plan import command_line, ds_json
from megatron_ds.plan.hardware import PlanError
from megatron_ds.plan.inputs import resolve
from megatron_ds.plan.zero_options import choose_all
from megatron_ds.testing.saved_tensors import graph_bytes
from megatron_ds.testing.scenario import tiny_config

SIZES = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128"]
SIZES += ["--vocab-size", "1024"]
TEACHER = ["--num-layers-teacher", "6", "--hidden-size-teacher", "384", "--num-attention-heads-teacher", "6"]
TRAINER = "--lr 1e-3 --train-iters 2 --mock-data --micro-batch-size 1 --global-batch-size 8".split()


def planned(*argv: str):
    return resolve(command_line.parse(["memory", *SIZES, *argv])[1])


def write_teacher(root: Path, **sizes: int) -> str:
    """A checkpoint directory as pretrain_gpt.py --save leaves it, as far as its metadata goes (no tensors: the
    planner and the trainer's launch check read megatron_ds.json alone)."""
    student = parse_config([*SIZES, *TRAINER], 1)[0].model
    model = dataclasses.replace(student, **sizes)
    (root / "global_step5").mkdir(parents=True)
    (root / "latest").write_text("global_step5")
    (root / "global_step5" / "megatron_ds.json").write_text(json.dumps({"config": Config(model=model).to_dict()}))
    return str(root)


# --- the teacher's sizes and the trainer's refusals ---------------------------------------------------------------


def test_without_a_checkpoint_or_the_sizes_one_line_asks_for_them() -> None:
    with pytest.raises(PlanError) as err:
        planned("--kd", "--num-layers-teacher", "6")
    assert str(err.value) == (
        "--kd: the planner needs the teacher's sizes: give --load-teacher DIR (its checkpoint) or "
        "--hidden-size-teacher --num-attention-heads-teacher"
    )


def test_the_sizes_from_the_flags_make_the_teacher_the_students_architecture_with_its_own_sizes() -> None:
    res = planned("--mos", *TEACHER, "--swiglu")
    teacher, student = res.teacher(1), res.model(1)
    assert (teacher.num_layers, teacher.hidden_size, teacher.num_attention_heads) == (6, 384, 6)
    assert teacher.activation == student.activation == "swiglu" and teacher.vocab_size == student.vocab_size
    # the MLP width pretrain_gpt.py gives a model of that width
    assert (
        teacher.ffn_hidden_size
        == parse_config(
            [*SIZES[:2], "--hidden-size", "384", "--num-attention-heads", "6", *SIZES[6:], "--swiglu", *TRAINER], 1
        )[0].model.ffn_hidden_size
    )


def test_the_checkpoints_sizes_are_read_and_the_flags_must_agree_as_the_trainer_says(tmp_path: Path) -> None:
    from megatron_ds.training.distillation import check_teacher

    path = write_teacher(tmp_path / "t", num_layers=6, hidden_size=384, num_attention_heads=6, ffn_hidden_size=1000)
    teacher = planned("--kd", "--load-teacher", path).teacher(1)
    assert (teacher.num_layers, teacher.hidden_size, teacher.ffn_hidden_size) == (6, 384, 1000)
    with pytest.raises(PlanError) as err:
        planned("--kd", "--load-teacher", path, "--num-layers-teacher", "8")
    config = parse_config([*SIZES, *TRAINER, "--kd", "--load-teacher", path, "--num-layers-teacher", "8"], 1)[0]
    with pytest.raises(UserError) as expected:
        check_teacher(config)
    assert str(err.value) == str(expected.value) and "\n" not in str(err.value)
    with pytest.raises(PlanError, match=r"^--load-teacher .*missing: no such directory; give a checkpoint directory$"):
        planned("--kd", "--load-teacher", str(tmp_path / "missing"))


def test_tensor_sizes_that_do_not_divide_the_teachers_heads_are_left_out_or_refused(tmp_path: Path) -> None:
    path = write_teacher(tmp_path / "t", num_layers=2, hidden_size=384, num_attention_heads=6, ffn_hidden_size=1536)
    res = planned("--kd", "--load-teacher", path, "--num-gpus", "8", "--gpus-per-node", "8")
    assert [t for t, _ in res.teachers] == [1, 2]  # 4 divides the student's 4 heads, not the teacher's 6
    with pytest.raises(PlanError, match="the teacher's attention heads 6 is not divisible by --tensor-model-parallel"):
        planned("--kd", "--load-teacher", path, "--tensor-model-parallel-size", "4", "--num-gpus", "8")


@pytest.mark.parametrize(
    "argv", ["--pipeline-model-parallel-size 2", "--num-key-value-heads 2"], ids=["pipeline", "gqa"]
)
def test_what_the_trainer_refuses_with_kd_is_refused_with_its_own_line(argv: str) -> None:
    with pytest.raises(PlanError) as err:
        planned("--kd", *TEACHER, "--num-gpus", "8", *argv.split())
    with pytest.raises(ConfigError) as expected:
        parse_config([*SIZES, *TRAINER, "--kd", "--load-teacher", "T", *TEACHER, *argv.split()], 8)
    assert str(err.value) == str(expected.value) and "\n" not in str(err.value)


# --- memory ------------------------------------------------------------------------------------------------------

TINY = tiny_config().model


@pytest.mark.parametrize("tp", [1, 2])
def test_the_kd_losss_saved_tensors_are_what_its_autograd_graph_keeps(tp: int) -> None:
    """kd_loss (T = 1) and one shard of vocab_parallel_kd_loss (T > 1, v / T logits) on CPU: the graph's bytes beside
    the student's logits equal `kd_loss_terms`."""
    b, v = 3, TINY.vocab_size // tp
    student = torch.randn(b, TINY.seq_length, v, requires_grad=True)
    teacher = torch.randn(b, TINY.seq_length, v)
    if tp == 1:
        out = kd_loss(student, teacher, 2.0, 0.5, TINY.seq_length)
    else:
        out = vocab_parallel_kd_loss(student, teacher, 2.0, 0.5, TINY.seq_length, b, None)
    assert graph_bytes(out, [student]) == sum(distillation_costs.kd_loss_terms(TINY, b, tp).values())


def test_the_teachers_weights_are_its_built_parameters_in_the_precision_and_nothing_else_of_it() -> None:
    from megatron_ds.inference.model import GPTModel

    teacher = dataclasses.replace(TINY, num_layers=3, hidden_size=96, ffn_hidden_size=200)
    with torch.device("meta"):
        built = sum(p.numel() for p in GPTModel(teacher).parameters())
    assert distillation_costs.teacher_params(teacher, 1) == built
    base = MemoryInputs(TINY, 2, 4, precision="bf16", zero_stage=2, data_parallel_size=4, engine="plain")
    kd = dataclasses.replace(base, teacher=teacher)
    without, with_kd = (stage_memory_for(i, 0, 1, TINY.num_layers) for i in (base, kd))
    assert with_kd.params - without.params == with_kd.teacher == 2 * built
    assert (with_kd.grads, with_kd.optimizer, with_kd.host) == (without.grads, without.optimizer, without.host)
    kd_terms = distillation_costs.kd_loss_terms(TINY, 2, 1)
    assert with_kd.activation_per_micro_batch - without.activation_per_micro_batch == sum(kd_terms.values())
    head = {s.name: s for s in spec_memory(kd)}[naming.LOGITS_TO_FP32]
    assert kd_terms.items() <= head.activation_terms.items()
    assert with_kd.total > without.total + with_kd.teacher  # the teacher's forward and the kd loss's temporaries


def test_the_forward_transient_is_the_kd_losss_temporaries_when_the_logits_dominate() -> None:
    logits = distillation_costs.logits_bytes(TINY, 2, 1)
    assert distillation_costs.forward_transient(TINY, 2, 1, 2)[0] == 4 * logits  # teacher logits + 3 in kl_div
    wide = dataclasses.replace(TINY, vocab_size=TINY.vocab_size * 2)
    assert distillation_costs.forward_transient(wide, 2, 2, 2)[0] == 6 * distillation_costs.logits_bytes(wide, 2, 2)


# --- time --------------------------------------------------------------------------------------------------------


def test_the_teachers_forward_and_the_kd_loss_join_every_micro_batch_and_model_flops_stay_the_students() -> None:
    model = parse_config([*SIZES, *TRAINER], 1)[0].model
    teacher = dataclasses.replace(model, num_layers=6, hidden_size=384, num_attention_heads=6, ffn_hidden_size=1536)
    device = find_device("A100-80GB")
    kernels, links = Kernels.for_device(device, "bf16"), Links.for_device(device, 8)
    features = deepspeed_features(2, 2)
    plain = StepInputs(model, (4,), (10**7,), 2, 4, 2, 4, "bf16", 2, False, 8)
    kd = dataclasses.replace(plain, teacher=teacher)
    without, with_kd = (predict_step(i, kernels, links, features) for i in (plain, kd))
    forward, backward, parts = distillation_costs.step_times(teacher, 2, 2, 2, kernels, links, features)
    assert with_kd.forward[0] - without.forward[0] == pytest.approx(forward)
    assert with_kd.backward[0] - without.backward[0] == pytest.approx(backward)
    assert with_kd.parts["teacher forward"] == parts["teacher forward"] > 0 and parts["kd loss"] > 0
    assert with_kd.seconds > without.seconds + 4 * forward * 0.99  # four micro-batches each way
    assert with_kd.model_flops == without.model_flops == model_flops_per_iteration(model, plain.global_batch_size)
    tokens = plain.global_batch_size * model.seq_length
    assert with_kd.hardware_flops - without.hardware_flops == pytest.approx(
        model_flops_per_iteration(teacher, tokens // model.seq_length) / 3
    )


# --- the search and its command -----------------------------------------------------------------------------------


def test_the_search_keeps_pipeline_size_1_and_its_command_parses_in_the_trainer(tmp_path: Path) -> None:
    path = write_teacher(tmp_path / "t", num_layers=6, hidden_size=384, num_attention_heads=4, ffn_hidden_size=1536)
    argv = [*SIZES, "--kd", "--load-teacher", path, "--num-gpus", "4", "--gpus-per-node", "4"]
    res = resolve(command_line.parse([*argv, "--gpu", "A100-80GB", "--global-batch-size", "16"])[1])
    choice = choose_all(res, "bf16")
    assert {c.pp for c in choice.ranked} == {1} and {c.tp for c in choice.ranked} >= {1, 2}
    assert {c.zero_stage for c in choice.ranked} >= {0, 3} and all(c.engine == "plain" for c in choice.ranked)
    best = choice.candidate
    assert best.inputs.teacher == res.teacher(best.tp)
    config = ds_json.plan_config(res, best)
    tokens = shlex.split(ds_json.command_line(res, config).split("\n", 1)[1].replace("\\\n", " "))
    tokens = tokens[tokens.index("pretrain_gpt.py") + 1 :]
    parsed = parse_config(tokens, best.tp * best.dp)[0]
    assert parsed.distillation == dataclasses.replace(
        DistillationConfig(kd=True, load_teacher=path), num_layers_teacher=6, hidden_size_teacher=384,
        num_attention_heads_teacher=4,
    )  # fmt: skip
    assert parsed.parallel.pipeline_model_parallel_size == 1 and parsed.engine_kind == "plain"
    assert parsed.parallel.tensor_model_parallel_size == best.tp and parsed.training.zero_stage == best.zero_stage


# --- a mixture-of-experts teacher ---------------------------------------------------------------------------------

MOE_TEACHER = dict(num_layers=6, hidden_size=384, num_attention_heads=4, ffn_hidden_size=1536, num_experts=(6,))
"""A teacher with 6 experts on every 2nd of its 6 layers: E = 1 or 2 share them out on 8 GPUs (4 does not)."""
GPUS = ["--num-gpus", "8", "--gpus-per-node", "8"]


def trainer_config(path: str, *argv: str, world: int = 8) -> Config:
    return parse_config([*SIZES, *TRAINER, "--kd", "--load-teacher", path, *argv], world)[0]


def test_the_planner_takes_num_experts_teacher_from_the_trainers_declaration() -> None:
    from megatron_ds.flags import BY_NAME

    actions = {a.option_strings[0]: a for a in command_line.build_parser()._actions if a.option_strings}
    flag, action = BY_NAME["--num-experts-teacher"], actions["--num-experts-teacher"]
    assert action.help.startswith(flag.help) and (action.type, action.nargs) == (flag.type, flag.nargs) == (int, "+")


def test_a_moe_teachers_weights_on_a_rank_are_its_dense_parts_gates_and_experts_over_e() -> None:
    from deepspeed.pipe import LayerSpec

    from megatron_ds.config import RegularizationConfig
    from megatron_ds.model.gpt_pipe import build_layer_specs

    teacher = dataclasses.replace(TINY, num_experts=(4,), mlp_type="residual")
    names = naming.gpt_spec_groups(teacher).names
    for ep in (1, 2):  # the built layers (DeepSpeed's MoE layers, experts / E of them), the tied head counted once
        specs = build_layer_specs(teacher, RegularizationConfig(), 1234, expert_parallel_size=ep)
        built = sum(
            p.numel()
            for name, s in zip(names, specs, strict=True)
            if isinstance(s, LayerSpec) and name != naming.TIED_LM_HEAD
            for p in s.build().parameters()
        )
        assert distillation_costs.teacher_params(teacher, 1, ep) == built
    base = MemoryInputs(TINY, 2, 4, precision="bf16", zero_stage=2, data_parallel_size=4, engine="plain")
    one, two = (
        stage_memory_for(dataclasses.replace(base, teacher=teacher, expert_parallel_size=e), 0, 1, TINY.num_layers)
        for e in (1, 2)
    )
    expert = 2 * (teacher.fc1_rows * teacher.hidden_size + teacher.fc1_rows + teacher.ffn_hidden_size * 32 + 32)
    assert one.teacher == 2 * distillation_costs.teacher_params(teacher, 1, 1)
    assert one.teacher - two.teacher == 2 * 4 // 2 * expert  # two MoE layers, half of their 4 experts, bf16
    assert (one.grads, one.optimizer) == (two.grads, two.optimizer)  # the dense student's states do not change


def test_a_moe_teachers_forward_transient_is_its_moe_layers_no_grad_working_set_when_that_is_larger() -> None:
    # top-2 at capacity factor 2: 4 S slots through the experts, more than a dense layer's working set
    teacher = dataclasses.replace(
        TINY, num_experts=(8,), hidden_size=256, ffn_hidden_size=1024, moe_top_k=2, moe_train_capacity_factor=2.0
    )
    size, what = distillation_costs.forward_transient(teacher, 4, 1, 2, ep=2)
    saved = sum(distillation_costs.kd_loss_terms(teacher, 4, 1).values())
    assert what == "one teacher MoE layer's no-grad working set"
    assert size == moe_costs.forward_working_set(teacher, 4, 8, 2, 2) - saved
    assert size > distillation_costs.forward_transient(dataclasses.replace(teacher, num_experts=(1,)), 4, 1, 2)[0]


def test_a_moe_teachers_forward_has_its_moe_layers_and_their_all_to_alls_over_the_students_e() -> None:
    model = parse_config([*SIZES, *TRAINER], 1)[0].model
    teacher = dataclasses.replace(model, **MOE_TEACHER)
    device = find_device("A100-80GB")
    kernels, links = Kernels.for_device(device, "bf16"), Links.for_device(device, 8)
    features = deepspeed_features(1, 2)
    forward, _, parts = distillation_costs.step_times(teacher, 2, 1, 2, kernels, links, features, all_to_all=(2, True))
    one = links.all_to_all(moe_costs.all_to_all_bytes(teacher, 2, 6, 2), 2, True)
    assert parts["teacher all-to-all"] == pytest.approx(3 * 2 * one)  # 3 MoE layers, 2 all-to-alls each forward
    dense = dataclasses.replace(teacher, num_experts=(1,))
    moe_layer = layer_times(teacher, 2, 1, 2, kernels, links, features, False, num_experts=6, all_to_all=(2, True))
    dense_layer = layer_times(dense, 2, 1, 2, kernels, links, features, False)
    dense_forward = distillation_costs.step_times(dense, 2, 1, 2, kernels, links, features)[0]
    assert forward - dense_forward == pytest.approx(3 * (moe_layer.forward - dense_layer.forward))
    assert "teacher all-to-all" not in distillation_costs.step_times(dense, 2, 1, 2, kernels, links, features)[2]
    plain = StepInputs(model, (4,), (10**7,), 2, 4, 1, 8, "bf16", 2, False, 8, expert_parallel_size=2)
    step = predict_step(dataclasses.replace(plain, teacher=teacher), kernels, links, features)
    assert step.parts["teacher all-to-all"] == pytest.approx(parts["teacher all-to-all"])


def test_the_search_tries_only_an_e_dividing_the_teachers_experts_and_a_dense_student_keeps_it(
    tmp_path: Path,
) -> None:
    from megatron_ds.training.distillation import check_teacher

    path = write_teacher(tmp_path / "t", **MOE_TEACHER)
    argv = [*SIZES, "--kd", "--load-teacher", path, *GPUS, "--gpu", "A100-80GB", "--global-batch-size", "16"]
    res = resolve(command_line.parse(argv)[1])
    assert [t for t, _ in res.teachers] == [1] and res.moe_teacher.experts_per_layer == (1, 6) * 3
    choice = choose_all(res, "bf16")
    assert {c.expert_parallel_size for c in choice.ranked} == {1, 2}  # divisors of 8 GPUs and of the 6 experts
    assert {c.zero_stage for c in choice.ranked} == {0, 1, 2} and {(c.tp, c.pp) for c in choice.ranked} == {(1, 1)}
    best = choice.candidate
    assert best.inputs.teacher == res.teacher(1) and best.inputs.expert_parallel_size == best.expert_parallel_size
    config = ds_json.plan_config(res, best)
    tokens = shlex.split(ds_json.command_line(res, config).split("\n", 1)[1].replace("\\\n", " "))
    tokens = tokens[tokens.index("pretrain_gpt.py") + 1 :]
    assert tokens[tokens.index("--num-experts-teacher") + 1] == "6"
    parsed = parse_config(tokens, best.dp)[0]
    assert parsed.distillation.num_experts_teacher == (6,) and not parsed.model.is_moe
    assert parsed.parallel.expert_parallel_size == best.expert_parallel_size
    check_teacher(parsed)  # the trainer's launch check takes the planned command with this checkpoint
    moe_student = resolve(command_line.parse([*argv, "--num-experts", "4"])[1])
    assert {c.expert_parallel_size for c in choose_all(moe_student, "bf16").ranked} == {1, 2}  # 4 and 6 both


def test_a_moe_teacher_sized_by_its_flags_takes_the_students_moe_flags_and_its_command_parses() -> None:
    res = resolve(
        command_line.parse(
            [*SIZES, "--mos", *TEACHER, "--num-experts-teacher", "4", "--num-experts", "2", "--expert-interval", "1",
             "--mlp-type", "residual", *GPUS, "--gpu", "A100-80GB", "--global-batch-size", "16"]
        )[1]
    )  # fmt: skip
    teacher = res.moe_teacher
    assert teacher.experts_per_layer == (4,) * 6 and teacher.mlp_type == "residual" and teacher.num_layers == 6
    best = choose_all(res, "bf16").candidate
    assert best.expert_parallel_size in (1, 2)  # divides the student's 2 experts and the teacher's 4
    tokens = shlex.split(
        ds_json.command_line(res, ds_json.plan_config(res, best)).split("\n", 1)[1].replace("\\\n", " ")
    )
    tokens = tokens[tokens.index("pretrain_gpt.py") + 1 :]
    parsed = parse_config(tokens, best.dp)[0]
    assert parsed.distillation.num_experts_teacher == (4,) and parsed.distillation.mos
    assert parsed.parallel.expert_parallel_size == best.expert_parallel_size
    dense = planned("--kd", *TEACHER, "--num-experts", "2", "--expert-interval", "1", "--num-experts-teacher", "1")
    assert dense.moe_teacher is None and dense.teacher(1).experts_per_layer == (1,) * 6


@pytest.mark.parametrize(
    "argv",
    [
        "--moe-expert-parallel-size 4",  # divides the 8 GPUs, not the teacher's 6 experts
        "--tensor-model-parallel-size 2",
        "--zero-stage 3",
        "--num-experts-teacher 8",  # the checkpoint has 6
    ],
)
def test_what_the_trainer_refuses_with_a_moe_teacher_is_refused_with_its_own_line(tmp_path: Path, argv: str) -> None:
    from megatron_ds.training.distillation import check_teacher

    path = write_teacher(tmp_path / "t", **MOE_TEACHER)
    with pytest.raises(PlanError) as err:
        planned("--kd", "--load-teacher", path, *GPUS, *argv.split())
    with pytest.raises(UserError) as expected:
        check_teacher(trainer_config(path, *argv.split()))
    assert str(err.value) == str(expected.value) and "\n" not in str(err.value)


def test_the_teacher_flags_refusals_name_them() -> None:
    with pytest.raises(PlanError) as err:
        planned("--kd", *TEACHER, "--num-experts-teacher", "4", "8", *GPUS)
    assert str(err.value) == (
        "--num-experts-teacher 4 8 gives 2 counts, but --num-layers-teacher 6 with --expert-interval 2 has 3 expert "
        "layers; give one count, or 3"
    )
    with pytest.raises(PlanError) as err:
        planned("--kd", *TEACHER, "--num-experts-teacher", "6", *GPUS, "--moe-expert-parallel-size", "4")
    assert str(err.value).startswith(
        "--kd: a mixture-of-experts teacher (--num-experts 6): --moe-expert-parallel-size 4"
    )
    with pytest.raises(PlanError) as err:  # E must divide the data-parallel size: Config's own line
        planned("--kd", *TEACHER, "--num-experts-teacher", "6", *GPUS, "--moe-expert-parallel-size", "3")
    with pytest.raises(ConfigError) as expected:
        trainer_config("T", *TEACHER, "--num-experts-teacher", "6", "--moe-expert-parallel-size", "3")
    assert str(err.value) == str(expected.value)


def test_the_zero_table_shows_the_teachers_weights_once_unpartitioned_and_counts_them_in_the_fit() -> None:
    from megatron_ds.estimate.distillation_costs import teacher_weight_bytes
    from megatron_ds.plan.context import Context
    from megatron_ds.plan.zero import zero_section

    argv = ["--kd", *TEACHER, "--num-gpus", "8", "--gpus-per-node", "8", "--gpu", "A100-80GB"]
    res = planned(*argv)
    sec = zero_section(Context(res, "bf16", ""))
    expected = teacher_weight_bytes(res.teacher(1), 1, 2)
    assert sec.data["teacher_weight_bytes"] == expected > 0
    alone = zero_section(Context(planned(*argv[len(TEACHER) + 1 :]), "bf16", ""))
    for r, s in zip(sec.data["rows"], alone.data["rows"]):
        assert r["gpu_states"] == s["gpu_states"]  # the student's states, the teacher on its own line
    assert sum("teacher's weights" in line for line in sec.lines) == 1
    assert not any("teacher" in line for line in alone.lines)


def test_a_distilling_run_that_does_not_fit_asks_for_gpus_not_for_pipeline_parallelism() -> None:
    """pretrain_gpt.py distils at P = 1 and every tensor size the teacher allows was tried."""
    argv = ["--model", "1.3b", "--num-gpus", "8", "--gpu", "V100-16GB", "--kd", "--num-layers-teacher", "96"]
    argv += ["--hidden-size-teacher", "12288", "--num-attention-heads-teacher", "96"]
    with pytest.raises(PlanError, match="does not fit") as caught:
        choose_all(resolve(command_line.parse(argv)[1]), "fp16")
    assert "pipeline size 1" in str(caught.value) and "pipeline/tensor" not in str(caught.value)
