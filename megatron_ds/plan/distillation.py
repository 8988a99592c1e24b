"""Knowledge distillation (`--kd`, `--mos`) as pretrain_gpt.py runs it, for the planner: the teacher's architecture and
what the trainer refuses with it.

The teacher is sized as the trainer sizes it (`training/checkpoint/teacher.py`, read without torch): from
`--load-teacher DIR`'s latest `megatron_ds.json` (its layers, width, heads, MLP width and its MLPs: dense, or its
experts per layer, expert interval, `--mlp-type` and routing; the `--*-teacher` flags, when given, must agree), or,
without a checkpoint, from `--num-layers-teacher`, `--hidden-size-teacher` and `--num-attention-heads-teacher` (its MLP
width then what pretrain_gpt.py gives a model of that width) and `--num-experts-teacher` (not given or 1: dense MLPs;
else its experts with the student's `--expert-interval`, `--mlp-type` and routing flags, as Megatron-DeepSpeed's
`setup_teacher_model` swaps the count into the student's flags); everything else is the student's. A
mixture-of-experts teacher shares the student's expert-parallel groups (E): the search tries only an E that divides
its expert counts too (`plan/experts.py`), T = 1 and ZeRO 0-2. Every refusal is the trainer's own line:
`Config._check_distillation` and `Config._check_experts` (pipeline size 1, no grouped-query attention, E dividing the
data-parallel size) asked through a config tree, and the checkpoint's checks (`teacher_model`, `check_sharding`,
`check_experts`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_ds.config import Config, DistillationConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from megatron_ds.errors import ConfigError
from megatron_ds.plan import experts, hardware
from megatron_ds.plan.hardware import PlanError
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.checkpoint.teacher import (
    OWN_FIELDS,
    check_experts,
    check_sharding,
    open_teacher,
    teacher_model,
)

TEACHER_FLAGS = ("--num-layers-teacher", "--hidden-size-teacher", "--num-attention-heads-teacher")
"""The teacher's sizes on the command line (the trainer's declarations); `--num-experts-teacher` gives its experts."""
TEACHER_DIR_PLACEHOLDER = "TEACHER_DIR"
"""`--load-teacher`'s value in a printed command when the plan was sized from the flags alone."""


def distillation_config(raw: Any) -> DistillationConfig:
    """The trainer's section for the planner's inputs (`--load-teacher` stands in when not given: the plan needs the
    teacher's sizes only)."""
    return DistillationConfig(
        kd=bool(raw.kd),
        mos=bool(raw.mos),
        load_teacher=raw.load_teacher or TEACHER_DIR_PLACEHOLDER,
        num_layers_teacher=raw.num_layers_teacher,
        hidden_size_teacher=raw.hidden_size_teacher,
        num_attention_heads_teacher=raw.num_attention_heads_teacher,
        num_experts_teacher=tuple(raw.num_experts_teacher) if raw.num_experts_teacher else None,
    )


def refusal(
    raw: Any, model: ModelConfig, tp: int = 1, pp: int = 1, world: int | None = None, zero: int = 0, ep: int = 1
) -> str | None:
    """pretrain_gpt.py's one-line refusal of distilling into this configuration (None: it trains); `ep` the
    expert-parallel size, which a dense student keeps for a mixture-of-experts teacher."""
    return experts.refusal(model, tp, pp, world, zero, ep, distillation_config(raw))


def teacher_fields(raw: Any, dims: dict, tp: int = 1) -> tuple[tuple[str, Any], ...]:
    """The teacher's own fields (`OWN_FIELDS`: sizes and MLPs, dense or its experts) for a student of `dims` at tensor
    size `tp`, from `--load-teacher`'s checkpoint or the teacher flags; a PlanError with the trainer's line where it
    refuses (at the expert-parallel size and ZeRO stage the flags fix, 1 and 0 where the search chooses them)."""
    student = hardware.model_config(**dims, tensor_parallel_size=tp)
    distillation = distillation_config(raw)
    config = _student_config(student, tp, distillation, raw.moe_expert_parallel_size or 1, raw.zero_stage or 0)
    if raw.load_teacher:
        try:
            teacher = teacher_model(config, open_teacher(config))
            check_sharding(config, teacher)
            check_experts(config, teacher)
        except CheckpointError as e:
            raise PlanError(str(e)) from None
        return tuple((f, getattr(teacher, f)) for f in OWN_FIELDS)
    teacher = dataclasses.replace(student, **_flag_fields(raw, dims, distillation.flag))
    try:
        check_sharding(config, teacher)
        check_experts(config, teacher)
    except CheckpointError as e:
        raise PlanError(str(e).replace(f"--load-teacher {TEACHER_DIR_PLACEHOLDER}", distillation.flag)) from None
    return tuple((f, getattr(teacher, f)) for f in OWN_FIELDS)


def teacher_refusal(raw: Any, student: ModelConfig, teacher: ModelConfig, ep: int, zero: int) -> str | None:
    """The trainer's one-line refusal of this teacher beside a student at t = 1, expert-parallel size `ep` and ZeRO
    stage `zero` (`check_experts`: a mixture-of-experts teacher and ZeRO-3, an E that divides not its experts);
    None: it runs."""
    distillation = distillation_config(raw)
    try:
        check_experts(_student_config(student, 1, distillation, ep, zero), teacher)
    except CheckpointError as e:
        return str(e).replace(f"--load-teacher {TEACHER_DIR_PLACEHOLDER}", distillation.flag)
    return None


def _flag_fields(raw: Any, dims: dict, flag: str) -> dict[str, Any]:
    """The teacher's own fields from its flags: the model pretrain_gpt.py builds from the student's architecture
    flags with the teacher's sizes and `--num-experts-teacher` (1 when not given) as its `--num-experts`."""
    sizes = (raw.num_layers_teacher, raw.hidden_size_teacher, raw.num_attention_heads_teacher)
    if None in sizes:
        missing = " ".join(f for f, v in zip(TEACHER_FLAGS, sizes) if v is None)
        raise PlanError(
            f"{flag}: the planner needs the teacher's sizes: give --load-teacher DIR (its checkpoint) or {missing}"
        )
    layers, hidden, heads = sizes
    counts = [str(n) for n in raw.num_experts_teacher or (1,)]
    architecture = [*_without(dims.get("architecture", ()), "--num-experts"), "--num-experts", *counts]
    try:
        built = hardware.model_config(
            layers, hidden, heads, dims["seq_length"], dims["vocab_size"], architecture=tuple(architecture)
        )
    except ConfigError as e:  # the count rule of --num-experts, said of the teacher's flags
        given = " ".join(counts)
        text = str(e).replace(f"--num-experts {given} ", f"--num-experts-teacher {given} ")
        raise PlanError(text.replace(f"--num-layers {layers} ", f"--num-layers-teacher {layers} ")) from None
    return {f: getattr(built, f) for f in OWN_FIELDS}


def _without(tokens: Any, name: str) -> list[str]:
    """Command-line tokens without flag `name` and its values."""
    out, skipping = [], False
    for token in tokens:
        skipping = token == name or (skipping and not token.startswith("--"))
        if not skipping:
            out.append(token)
    return out


def _student_config(student: ModelConfig, tp: int, distillation: DistillationConfig, ep: int, zero: int) -> Config:
    """A config tree of the student at `tp` (and expert-parallel size `ep`, ZeRO stage `zero`) with its distillation
    section (what the teacher checks read)."""
    return Config(
        model=student,
        parallel=ParallelConfig(tensor_model_parallel_size=tp, world_size=tp * ep, expert_parallel_size=ep),
        training=TrainingConfig(zero_stage=zero, global_batch_size=ep),
        optimizer=OptimizerConfig(create_moe_param_group=student.is_moe),
        distillation=distillation,
    )
