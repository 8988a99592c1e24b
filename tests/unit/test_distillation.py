"""Knowledge distillation (--kd): the kd loss against a direct computation of Megatron-DeepSpeed's formula, its
vocabulary-parallel form against it (one process, and two gloo ranks each holding a vocabulary shard), the flag rules
and refusals, and the teacher checkpoint's checks (before any process group)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_ds.config import Config
from megatron_ds.errors import ConfigError, UserError
from megatron_ds.flags.parser import parse_config
from megatron_ds.model.distillation import kd_loss, vocab_parallel_kd_loss
from megatron_ds.testing.launch import forked_gloo_ranks
from megatron_ds.testing.scenario import tiny_config
from megatron_ds.training import distillation, logger
from megatron_ds.training.checkpoint.directory import META

BASE = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 128 --lr 1e-3"
BASE += " --micro-batch-size 2 --global-batch-size 4 --train-iters 2 --mock-data"


def parse(*extra: str, world_size: int = 1) -> Config:
    return parse_config([*BASE.split(), *extra], world_size=world_size)[0]


def direct_kd(student: torch.Tensor, teacher: torch.Tensor, t: float, beta: float, seq_length: int) -> torch.Tensor:
    """Megatron-DeepSpeed 4efb479's kd loss written out: T^2 sum_{b,s,v} p_t (log p_t - log q_s) / b / seq * beta."""
    p = torch.softmax(teacher.double() / t, dim=-1)
    log_q = torch.log_softmax(student.double() / t, dim=-1)
    kl = (p * (p.log() - log_q)).sum() / student.shape[0]
    return t * t * kl / seq_length * beta


@pytest.mark.parametrize("t, beta, seq_length", [(1.0, 1.0, 8), (2.0, 0.5, 16), (0.5, 3.0, 8)])
def test_kd_loss_is_upstream_formula(t: float, beta: float, seq_length: int) -> None:
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(3, 8, 50, generator=gen, requires_grad=True)
    teacher = torch.randn(3, 8, 50, generator=gen) * 2
    got = kd_loss(student, teacher, t, beta, seq_length)
    want = direct_kd(student.detach(), teacher, t, beta, seq_length)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert got.item() > 0
    got.backward()  # the student gets the gradient; the teacher (a plain tensor) none
    assert student.grad is not None and float(student.grad.abs().sum()) > 0


def test_kd_loss_of_identical_distributions_is_zero() -> None:
    logits = torch.randn(2, 4, 30, generator=torch.Generator().manual_seed(1))
    # 0 up to fp32 rounding: the teacher's log-probabilities come from softmax, the student's from log_softmax
    assert abs(kd_loss(logits, logits.clone(), 2.0, 1.0, 4).item()) < 1e-6


def test_kd_loss_divides_by_the_run_seq_length_not_the_curriculum_cut() -> None:
    gen = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(2, 4, 30, generator=gen), torch.randn(2, 4, 30, generator=gen)
    assert kd_loss(student, teacher, 1.0, 1.0, 16).item() == pytest.approx(
        kd_loss(student, teacher, 1.0, 1.0, 4).item() / 4, rel=1e-6
    )


def logits(seed: int, shape: tuple[int, ...] = (2, 3, 8)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_vocab_parallel_kd_loss_of_one_shard_is_kd_loss_with_its_gradient() -> None:
    student, teacher = logits(0).requires_grad_(), logits(1)
    want = kd_loss(student, teacher, 2.0, 0.5, 16)
    (want_grad,) = torch.autograd.grad(want, student)
    got = vocab_parallel_kd_loss(student, teacher, 2.0, 0.5, 16, batch_size=2, group=None)
    (got_grad,) = torch.autograd.grad(got, student)
    assert got.item() == pytest.approx(want.item(), abs=1e-7)
    assert torch.allclose(got_grad, want_grad, atol=1e-8)


def _sharded_kd(rank: int, sequence_first: bool) -> tuple[float, list]:
    """This rank's half of the vocabulary of the logits `logits(0)` / `logits(1)` (sequence-first when asked): the
    vocab-parallel kd loss and the gradient of 3 x it on this shard."""
    import torch.distributed as dist

    student, teacher = logits(0), logits(1)
    if sequence_first:  # (s, b, v) as under sequence parallelism; batchmean still divides by b
        student, teacher = student.transpose(0, 1), teacher.transpose(0, 1)
    student = student.chunk(2, dim=-1)[rank].contiguous().requires_grad_()
    loss = vocab_parallel_kd_loss(student, teacher.chunk(2, dim=-1)[rank], 2.0, 0.5, 16, 2, dist.group.WORLD)
    (3 * loss).backward()
    return loss.item(), student.grad.tolist()


@pytest.mark.parametrize("sequence_first", [False, True])
def test_vocab_parallel_kd_loss_on_two_shards_is_the_full_vocabularys(tmp_path: Path, sequence_first: bool) -> None:
    student = logits(0).requires_grad_()
    want = kd_loss(student, logits(1), 2.0, 0.5, 16)
    (3 * want).backward()
    want_grad = student.grad.transpose(0, 1) if sequence_first else student.grad
    results = forked_gloo_ranks(_sharded_kd, 2, str(tmp_path / "store"), sequence_first, timeout=60)
    for rank, (loss, grad) in enumerate(results):
        assert loss == pytest.approx(want.item(), abs=1e-7)
        assert torch.allclose(torch.tensor(grad), want_grad.chunk(2, dim=-1)[rank], atol=1e-8)
    # Megatron-DeepSpeed's per-shard softmax gives another loss: the test tells them apart
    per_shard = sum(kd_loss(s, t, 2.0, 0.5, 16) for s, t in zip(logits(0).chunk(2, -1), logits(1).chunk(2, -1)))
    assert abs(per_shard.item() - want.item()) > 1e-3


def test_kd_flags_set_the_section_and_the_plain_engine() -> None:
    config = parse("--kd", "--load-teacher", "t", "--kd-temp", "2", "--kd-beta-ce", "0.5", "--num-layers-teacher", "4")
    d = config.distillation
    assert (d.kd, d.load_teacher, d.kd_temp, d.kd_beta_ce, d.num_layers_teacher) == (True, "t", 2.0, 0.5, 4)
    assert config.engine_kind == "plain"  # Megatron-DeepSpeed's --no-pipeline-parallel engine
    assert parse().engine_kind == "pipeline" and not parse().distillation.kd


@pytest.mark.parametrize(
    "extra, world, message",
    [
        ([], 1, "--kd needs --load-teacher DIR"),
        (
            ["--load-teacher", "t", "--pipeline-model-parallel-size", "2"],
            2,
            "--kd with --pipeline-model-parallel-size 2",
        ),
        (["--load-teacher", "t", "--ds-sequence-parallel-size", "2"], 2, "--kd with --ds-sequence-parallel-size 2"),
        (["--load-teacher", "t", "--num-key-value-heads", "2"], 1, "--kd with --num-key-value-heads 2"),
        (["--load-teacher", "t", "--reset-position-ids"], 1, "--kd with --reset-position-ids"),
        (["--load-teacher", "t", "--num-experts-teacher", "0"], 1, "--num-experts-teacher 0 must be one or more"),
        (
            ["--load-teacher", "t", "--moe-expert-parallel-size", "2"],
            1,
            "--moe-expert-parallel-size 2 does not divide the data-parallel size 1",
        ),
        (["--load-teacher", "t", "--kd-temp", "0"], 1, "--kd-temp 0.0 must be > 0"),
    ],
)
def test_kd_refusals_are_one_line(extra: list[str], world: int, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse("--kd", *extra, world_size=world)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_mos_is_kds_loss_named_mos_loss_and_needs_a_teacher() -> None:
    config = parse("--mos", "--load-teacher", "t", "--num-experts", "4", "--kd-temp", "2")
    d = config.distillation
    assert (d.mos, d.kd, d.distils, d.loss_name, d.kd_temp) == (True, False, True, "mos loss", 2.0)
    assert config.engine_kind == "plain" and config.model.is_moe
    assert parse("--kd", "--load-teacher", "t").distillation.loss_name == "kd loss"
    assert parse("--kd", "--mos", "--load-teacher", "t").distillation.loss_name == "mos loss"  # upstream's order
    with pytest.raises(ConfigError, match=r"^--mos needs --load-teacher DIR"):
        parse("--mos")
    experts = parse("--mos", "--load-teacher", "t", "--num-experts-teacher", "2", "4").distillation.num_experts_teacher
    assert experts == (2, 4)
    with pytest.raises(ConfigError, match=r"^--mos with --pipeline-model-parallel-size 2"):
        parse("--mos", "--load-teacher", "t", "--pipeline-model-parallel-size", "2", world_size=2)


def test_mixture_of_experts_student_gets_a_dense_teacher(tmp_path: Path) -> None:
    path = fake_teacher(tmp_path / "t", tiny_config())
    config = tiny_config(
        model__num_layers=2,
        model__num_experts=(4,),
        model__moe_top_k=2,
        distillation__mos=True,
        distillation__load_teacher=path,
    )
    assert distillation.check_teacher(config) == []  # no NOTICE of routing fields either: the teacher routes nothing
    teacher = distillation.teacher_model(config, distillation.open_teacher(config))
    assert teacher == tiny_config().model and not teacher.is_moe and config.model.is_moe  # the checkpoint's, dense


def test_alpha_and_dropout_notices(capsys: pytest.CaptureFixture) -> None:
    parse("--kd", "--load-teacher", "t", "--kd-alpha-ce", "0.5", "--hidden-dropout", "0", "--attention-dropout", "0")
    err = capsys.readouterr().out
    assert "NOTICE: --kd-alpha-ce 0.5 scales nothing" in err and "without dropout" not in err
    parse("--kd", "--load-teacher", "t")
    err = capsys.readouterr().out
    assert "NOTICE: --kd: the teacher runs without dropout (eval mode)" in err and "kd-alpha-ce" not in err


def test_tensor_parallel_kd_is_accepted_with_a_notice_of_upstreams_per_shard_softmax(
    capsys: pytest.CaptureFixture,
) -> None:
    config = parse("--kd", "--load-teacher", "t", "--tensor-model-parallel-size", "2", world_size=2)
    assert (config.parallel.tensor_model_parallel_size, config.engine_kind) == (2, "plain")
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "--tensor-model-parallel-size" in x]
    assert line.startswith("NOTICE: --kd with --tensor-model-parallel-size 2: the kd loss is the full vocabulary's")
    assert "sum of per-shard KL divergences" in line
    parse("--kd", "--load-teacher", "t")
    assert "per-shard" not in capsys.readouterr().out


def test_teacher_flags_without_kd_are_ignored_with_a_warning(capsys: pytest.CaptureFixture) -> None:
    assert parse("--load-teacher", "t", "--num-experts-teacher", "4") == parse()
    assert (
        "--load-teacher, --num-experts-teacher: read only with --kd or --mos; ignored without them"
        in capsys.readouterr().err
    )


def fake_teacher(root: Path, config: Config) -> str:
    """A checkpoint directory as far as its metadata goes (what `check_teacher` reads)."""
    (root / "global_step2").mkdir(parents=True)
    (root / "global_step2" / META).write_text(json.dumps({"config": config.to_dict(), "train_state": {}}))
    (root / "latest").write_text("global_step2")
    return str(root)


def student(path: str, **overrides: object) -> Config:
    return tiny_config(model__num_layers=2, distillation__kd=True, distillation__load_teacher=path, **overrides)


def test_teacher_is_the_checkpoints_model_with_the_students_other_fields(tmp_path: Path) -> None:
    path = fake_teacher(tmp_path / "t", tiny_config(model__seq_length=8))  # 4 layers, trained on 8 tokens
    config = student(path)
    assert distillation.check_teacher(config) == [
        f"NOTICE: --load-teacher {path}: seq_length 8 -> 16: the teacher runs with the student's values (they shape "
        "no weight), as Megatron-DeepSpeed builds it from the student's flags"
    ]
    model = distillation.teacher_model(config, distillation.open_teacher(config))
    assert (model.num_layers, model.seq_length) == (4, 16)
    agreeing = config.replace(distillation__num_layers_teacher=4, distillation__hidden_size_teacher=32)
    assert distillation.teacher_model(agreeing, distillation.open_teacher(agreeing)) == model


def test_teacher_flag_that_disagrees_with_the_checkpoint_is_one_line(tmp_path: Path) -> None:
    path = fake_teacher(tmp_path / "t", tiny_config())
    with pytest.raises(UserError) as err:
        distillation.check_teacher(student(path, distillation__num_layers_teacher=12))
    assert str(err.value) == (
        f"--num-layers-teacher 12 disagrees with --load-teacher {path} (global_step2), whose model has num_layers 4; "
        "use --num-layers-teacher 4 (or drop it: the checkpoint's is taken)"
    )


def test_teacher_of_another_norm_or_vocabulary_is_refused(tmp_path: Path) -> None:
    path = fake_teacher(tmp_path / "t", tiny_config(model__normalization="rmsnorm", model__vocab_size=256))
    with pytest.raises(UserError) as err:
        distillation.check_teacher(student(path))
    text = str(err.value)
    assert text.startswith(f"--load-teacher {path} (global_step2) differs from the student beyond its layers")
    assert "vocab_size 256 (teacher) vs 128 (student)" in text and "normalization 'rmsnorm' (teacher)" in text
    assert "\n" not in text


def test_teacher_padded_for_another_tensor_size_names_the_padding_flag(tmp_path: Path) -> None:
    # the same 100 tokens padded to 128 rows at T = 1 (divisible by 128), to 256 at T = 2 (128 x 2)
    path = fake_teacher(tmp_path / "t", tiny_config(model__vocab_size=128))
    config = student(path, model__vocab_size=256, parallel__world_size=2, parallel__tensor_model_parallel_size=2)
    with pytest.raises(UserError) as err:
        distillation.check_teacher(config)
    text = str(err.value)
    assert "vocab_size 128 (teacher) vs 256 (student)" in text and "\n" not in text
    assert text.endswith(
        "(the padded vocabulary follows --make-vocab-size-divisible-by x --tensor-model-parallel-size; at T=2 choose "
        "--make-vocab-size-divisible-by so that the padded size stays 128)"
    )


def test_wider_teacher_loads_with_a_notice_of_what_upstream_would_build(tmp_path: Path) -> None:
    path = fake_teacher(tmp_path / "t", tiny_config(model__hidden_size=64, model__ffn_hidden_size=128))
    (notice,) = distillation.check_teacher(student(path))
    assert notice.startswith(f"NOTICE: --load-teacher {path}: the teacher is built with its own MLP width 64 (student)")
    assert "head size 8 (student) vs 16 (teacher)" in notice
    # --kv-channels: the teacher's head size is its checkpoint's too, whatever the student's
    path = fake_teacher(tmp_path / "kv", tiny_config(model__kv_channels=12))
    (notice,) = distillation.check_teacher(student(path))
    assert "head size 8 (student) vs 12 (teacher)" in notice
    config = student(str(tmp_path / "t"), model__kv_channels=12)
    assert distillation.teacher_model(config, distillation.open_teacher(config)).head_dim == 16


def test_teacher_whose_heads_the_tensor_size_does_not_divide_is_one_line(tmp_path: Path) -> None:
    teacher = tiny_config(model__hidden_size=48, model__num_attention_heads=6, model__ffn_hidden_size=96)
    path = fake_teacher(tmp_path / "t", teacher)
    config = student(path, parallel__world_size=4, parallel__tensor_model_parallel_size=4)
    with pytest.raises(UserError) as err:
        distillation.check_teacher(config)
    assert str(err.value) == (
        f"--load-teacher {path}: the teacher's attention heads 6 is not divisible by --tensor-model-parallel-size 4, "
        "and the teacher is tensor-parallel like the student; use a tensor-parallel size that divides 6"
    )


@pytest.mark.parametrize("make", ["missing", "empty", "damaged"])
def test_missing_or_unreadable_teacher_is_one_line(tmp_path: Path, make: str) -> None:
    path = tmp_path / "t"
    if make == "empty":
        path.mkdir()
    elif make == "damaged":
        fake_teacher(path, tiny_config())
        (path / "global_step2" / META).write_text("{")
    with pytest.raises(UserError) as err:
        distillation.check_teacher(student(str(path)))
    assert str(err.value).startswith(f"--load-teacher {path}") and "\n" not in str(err.value)


def test_log_line_gives_total_lm_and_kd_loss_in_upstreams_order() -> None:
    assert logger.losses_text(2.0, {}) == ["lm loss: 2.000000E+00"]
    assert logger.losses_text(2.0, {"kd loss": 0.25}) == [
        "total loss: 2.250000E+00",
        "lm loss: 2.000000E+00",
        "kd loss: 2.500000E-01",
    ]
    assert logger.losses_text(2.0, {"moe loss": 0.5, "mos loss": 0.25}) == [  # upstream's dict under --mos
        "total loss: 2.750000E+00",
        "lm loss: 2.000000E+00",
        "moe loss: 5.000000E-01",
        "mos loss: 2.500000E-01",
    ]


def test_the_planner_plans_kd_and_asks_for_the_teachers_sizes_in_one_line() -> None:
    from megatron_ds.plan.command_line import PlanError
    from megatron_ds.plan.command_line import parse as plan_parse
    from megatron_ds.plan.inputs import resolve

    argv = ["memory", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
    with pytest.raises(PlanError) as err:
        resolve(plan_parse([*argv, "--vocab-size", "256", "--kd"])[1])
    assert str(err.value).startswith("--kd: the planner needs the teacher's sizes") and "\n" not in str(err.value)


def test_megatron_deepspeed_teacher_is_sent_to_the_converter(tmp_path: Path) -> None:
    path = str(Path(__file__).resolve().parents[1] / "fixtures" / "megatron_deepspeed_checkpoints" / "tp1_pp2_tied")
    with pytest.raises(UserError) as err:
        distillation.check_teacher(student(path))
    text = str(err.value)
    assert text.startswith(f"--load-teacher {path}: a Megatron-DeepSpeed checkpoint") and "\n" not in text
    assert text.endswith(", then --load-teacher OUT")


def moe_teacher(root: Path, **overrides: object) -> str:
    """A mixture-of-experts teacher's metadata: 4 layers, experts in layers 2 and 4 (4 each unless overridden)."""
    overrides = {"model__num_experts": (4,), "model__moe_token_dropping": False, **overrides}
    return fake_teacher(root, tiny_config(**overrides))


def test_dense_student_keeps_its_expert_parallel_size_for_a_teacher_with_experts() -> None:
    config = parse("--kd", "--load-teacher", "t", "--moe-expert-parallel-size", "2", world_size=2)
    assert (config.parallel.expert_parallel_size, config.model.is_moe) == (2, False)
    assert parse("--moe-expert-parallel-size", "2", world_size=2).parallel.expert_parallel_size == 1  # no teacher


@pytest.mark.parametrize("given", [None, (4,), (4, 4)])
def test_mixture_of_experts_teacher_is_its_checkpoints(tmp_path: Path, given: tuple[int, ...] | None) -> None:
    path = moe_teacher(tmp_path / "t")
    config = student(path, distillation__num_experts_teacher=given, parallel__world_size=2)
    config = config.replace(parallel__expert_parallel_size=2)  # a dense student: its groups are the teacher's
    (notice,) = distillation.check_teacher(config)
    assert notice == (
        f"NOTICE: --load-teacher {path}: the mixture-of-experts teacher routes tokens as its checkpoint was trained "
        "(moe_top_k 1; moe_train_capacity_factor 1.0; moe_min_capacity 4; moe_token_dropping False; "
        "moe_top2_2nd_expert_sampling True), its gates at the train capacity factor; Megatron-DeepSpeed routes its "
        "teacher with the student's MoE flags"
    )
    teacher = distillation.teacher_model(config, distillation.open_teacher(config))
    assert teacher.experts_per_layer == (1, 4, 1, 4) and not teacher.moe_token_dropping


def test_a_teachers_shared_expert_and_router_are_its_checkpoints(tmp_path: Path) -> None:
    """A dense student's teacher with Megatron-LM's pre-softmax router and a gated shared expert is built with them
    (they shape its weights and its routing), not refused as differing from the student."""
    path = moe_teacher(
        tmp_path / "t",
        model__moe_router="megatron",
        model__moe_top_k=2,
        model__moe_router_pre_softmax=True,
        model__moe_shared_expert_size=24,
        model__moe_shared_expert_gate=True,
        model__add_bias_linear=False,
    )
    config = student(path, model__add_bias_linear=False)
    teacher = distillation.teacher_model(config, distillation.open_teacher(config))
    assert (teacher.moe_shared_expert_size, teacher.moe_shared_expert_gate) == (24, True)
    assert (teacher.moe_router, teacher.moe_top_k, teacher.moe_router_pre_softmax) == ("megatron", 2, True)
    assert (config.model.moe_shared_expert_size, config.model.is_moe) == (0, False)


def test_moe_students_own_routing_gives_no_notice_and_another_names_each_field(tmp_path: Path) -> None:
    path = moe_teacher(tmp_path / "t")
    same = student(path, model__num_experts=(2,), model__moe_token_dropping=False)
    assert distillation.check_teacher(same) == []
    (notice,) = distillation.check_teacher(same.replace(model__moe_top_k=2, model__moe_min_capacity=2))
    assert "(moe_top_k 1 (student: 2); moe_min_capacity 4 (student: 2))," in notice


@pytest.mark.parametrize(
    "given, message",
    [
        ((1,), "--num-experts-teacher 1 disagrees"),
        ((2,), "--num-experts-teacher 2 disagrees"),
        ((4, 4, 4), "--num-experts-teacher 4 4 4 disagrees"),
        ((4, 2), "--num-experts-teacher 4 2 disagrees"),
    ],
)
def test_num_experts_teacher_that_disagrees_with_the_checkpoint_is_one_line(
    tmp_path: Path, given: tuple[int, ...], message: str
) -> None:
    path = moe_teacher(tmp_path / "t")
    with pytest.raises(UserError) as err:
        distillation.check_teacher(student(path, distillation__num_experts_teacher=given))
    assert str(err.value) == (
        f"{message} with --load-teacher {path} (global_step2), whose model has --num-experts 4 (experts per layer "
        "[1, 4, 1, 4]); use --num-experts-teacher 4 (or drop it: the checkpoint's is taken)"
    )


def test_dense_teacher_takes_num_experts_teacher_1_and_refuses_more(tmp_path: Path) -> None:
    path = fake_teacher(tmp_path / "t", tiny_config())
    assert distillation.check_teacher(student(path, distillation__num_experts_teacher=(1,))) == []
    with pytest.raises(
        UserError, match=r"^--num-experts-teacher 4 disagrees with .*, whose model has --num-experts 1 "
    ):
        distillation.check_teacher(student(path, distillation__num_experts_teacher=(4,)))


@pytest.mark.parametrize(
    "overrides, why",
    [
        (
            {"parallel__world_size": 4, "parallel__expert_parallel_size": 4},
            "--moe-expert-parallel-size 4 does not divide its 6 experts, and it shares out its experts over the "
            "student's expert-parallel groups; choose a --moe-expert-parallel-size that divides every expert count of "
            "the student and the teacher",
        ),
        (
            {"parallel__world_size": 2, "parallel__tensor_model_parallel_size": 2},
            "its MoE layers are not tensor-parallel here, and the student runs at --tensor-model-parallel-size 2; use "
            "--tensor-model-parallel-size 1",
        ),
        (
            {"training__zero_stage": 3},
            "--zero-stage 3 is not run with MoE layers here (DeepSpeed refuses ZeRO-3 with them); use --zero-stage 0, "
            "1 or 2",
        ),
    ],
)
def test_teacher_experts_the_run_cannot_hold_are_one_line(tmp_path: Path, overrides: dict, why: str) -> None:
    path = moe_teacher(tmp_path / "t", model__num_experts=(6,))
    with pytest.raises(UserError) as err:
        distillation.check_teacher(student(path, **overrides))
    assert str(err.value) == f"--load-teacher {path}: a mixture-of-experts teacher (--num-experts 6): {why}"


def test_universal_form_of_a_moe_teacher_is_one_line(tmp_path: Path) -> None:
    path = moe_teacher(tmp_path / "t")
    meta = tmp_path / "t" / "global_step2" / META
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "format": "megatron_ds.universal"}))
    with pytest.raises(UserError) as err:
        distillation.check_teacher(student(path))
    assert str(err.value).startswith(f"--load-teacher {path}: a universal checkpoint (training state, no per-expert")


def test_the_planner_sizes_a_moe_teacher_as_the_trainer_reads_it(tmp_path: Path) -> None:
    """The planner asks the same checks (`teacher_model`, `check_experts`): its teacher is the checkpoint's, experts and
    routing included (what it prices: tests/unit/test_plan_distillation.py)."""
    from types import SimpleNamespace

    from megatron_ds.plan import distillation as plan_distillation
    from megatron_ds.training.checkpoint.teacher import OWN_FIELDS

    path = moe_teacher(tmp_path / "t")
    raw = SimpleNamespace(
        kd=True,
        mos=False,
        load_teacher=path,
        num_layers_teacher=None,
        hidden_size_teacher=None,
        num_attention_heads_teacher=None,
        num_experts_teacher=None,
        moe_expert_parallel_size=None,
        zero_stage=None,
    )
    dims = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 128}
    fields = dict(plan_distillation.teacher_fields(raw, {**dims, "ffn_hidden_size": 64}))
    config = student(path)
    teacher = distillation.teacher_model(config, distillation.open_teacher(config))
    assert fields == {f: getattr(teacher, f) for f in OWN_FIELDS} and fields["num_experts"] == (4,)
