"""Knowledge distillation (`--kd`, `--mos`) as pretrain_gpt.py runs it, for the planner: the teacher's architecture and
what the trainer refuses with it.

The teacher is sized as the trainer sizes it (`training/checkpoint/teacher.py`, read without torch): from
`--load-teacher DIR`'s latest `megatron_ds.json` (its layers, width, heads and MLP width; the `--*-teacher` flags, when
given, must agree), or, without a checkpoint, from `--num-layers-teacher`, `--hidden-size-teacher` and
`--num-attention-heads-teacher` (its MLP width then what pretrain_gpt.py gives a model of that width); everything else is
the student's. A mixture-of-experts teacher, which pretrain_gpt.py trains with, is refused in one line (its experts are
not priced). Every other refusal is the trainer's own line: `Config._check_distillation` (pipeline size 1, no grouped-query
attention) asked through a config tree, and the checkpoint's checks (`teacher_model`, `check_sharding`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_ds.config import Config, DistillationConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from megatron_ds.errors import ConfigError
from megatron_ds.plan import hardware
from megatron_ds.plan.hardware import PlanError
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.checkpoint.teacher import OWN_FIELDS, check_sharding, open_teacher, teacher_model

TEACHER_FLAGS = ("--num-layers-teacher", "--hidden-size-teacher", "--num-attention-heads-teacher")
"""The teacher's sizes on the command line (the trainer's declarations)."""
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
    )


def refusal(
    raw: Any, model: ModelConfig, tp: int = 1, pp: int = 1, world: int | None = None, zero: int = 0
) -> str | None:
    """pretrain_gpt.py's one-line refusal of distilling into this configuration (None: it trains)."""
    world = world or tp * pp
    try:
        Config(
            model=model,
            parallel=ParallelConfig(pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp, world_size=world),
            training=TrainingConfig(zero_stage=zero, global_batch_size=max(1, world // (tp * pp))),
            optimizer=OptimizerConfig(create_moe_param_group=model.is_moe),
            distillation=distillation_config(raw),
        )
    except ConfigError as e:
        return str(e)
    return None


def teacher_fields(raw: Any, dims: dict, tp: int = 1) -> tuple[tuple[str, Any], ...]:
    """The teacher's own fields (`OWN_FIELDS`: sizes and its dense MLPs) for a student of `dims` at tensor size `tp`,
    from `--load-teacher`'s checkpoint or the teacher flags; a PlanError with the trainer's line where it refuses."""
    student = hardware.model_config(**dims, tensor_parallel_size=tp)
    distillation = distillation_config(raw)
    flag = distillation.flag
    config = _student_config(student, tp, distillation)
    if raw.load_teacher:
        try:
            teacher = teacher_model(config, open_teacher(config))
            check_sharding(config, teacher)
        except CheckpointError as e:
            raise PlanError(str(e)) from None
        if teacher.is_moe:
            raise PlanError(
                f"--load-teacher {raw.load_teacher}: a mixture-of-experts teacher (--num-experts "
                f"{' '.join(map(str, teacher.num_experts))}) is not priced by the planner (pretrain_gpt.py trains with "
                f"it); plan the student without {flag}, or with a dense teacher's --load-teacher"
            )
        return tuple((f, getattr(teacher, f)) for f in OWN_FIELDS)
    sizes = (raw.num_layers_teacher, raw.hidden_size_teacher, raw.num_attention_heads_teacher)
    if None in sizes:
        missing = " ".join(f for f, v in zip(TEACHER_FLAGS, sizes) if v is None)
        raise PlanError(
            f"{flag}: the planner needs the teacher's sizes: give --load-teacher DIR (its checkpoint) or {missing}"
        )
    layers, hidden, heads = sizes
    ffn = hardware.model_config(
        layers, hidden, heads, dims["seq_length"], dims["vocab_size"], architecture=dims.get("architecture", ())
    ).ffn_hidden_size
    dense = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in OWN_FIELDS}  # its MLPs dense
    sizes = {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "ffn_hidden_size": ffn}
    teacher = dataclasses.replace(student, **{**dense, **sizes})
    try:
        check_sharding(config, teacher)
    except CheckpointError as e:
        raise PlanError(str(e).replace(f"--load-teacher {TEACHER_DIR_PLACEHOLDER}", flag)) from None
    return tuple((f, getattr(teacher, f)) for f in OWN_FIELDS)


def _student_config(student: ModelConfig, tp: int, distillation: DistillationConfig) -> Config:
    """A config tree of the student at `tp` with its distillation section (what the teacher checks read)."""
    return Config(
        model=student,
        parallel=ParallelConfig(tensor_model_parallel_size=tp, world_size=tp),
        optimizer=OptimizerConfig(create_moe_param_group=student.is_moe),
        distillation=distillation,
    )
