"""The teacher of knowledge distillation (`--kd`, `--mos`) by its checkpoint's metadata alone (no torch): which
checkpoint `--load-teacher` names, the teacher's architecture (its own sizes from its saved config, the `--*-teacher`
flags agreeing, the rest the student's) and the tensor-parallel split it must allow. `training/distillation.py` loads
it from these; the planner sizes it from them (`plan/distillation.py`), so both give the same one-line errors."""

from __future__ import annotations

import dataclasses
import os

from megatron_ds.config import Config, ModelConfig
from megatron_ds.config.model import MOE_ROUTING_FIELDS
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.checkpoint.opening import Checkpoint, open_checkpoint
from megatron_ds.training.checkpoint.rules import WEIGHT_FREE_FIELDS, vocabulary_hint

TEACHER_SIZES = (
    ("num_layers", "--num-layers-teacher", "num_layers_teacher"),
    ("hidden_size", "--hidden-size-teacher", "hidden_size_teacher"),
    ("num_attention_heads", "--num-attention-heads-teacher", "num_attention_heads_teacher"),
)
"""(ModelConfig field, flag, DistillationConfig field): what upstream swaps into the student's args."""
OWN_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "num_experts",
    "expert_interval",
    "mlp_type",
    *MOE_ROUTING_FIELDS,
)
"""The teacher's own sizes, read from its checkpoint, and its (dense) MLPs: a mixture-of-experts student distils from
a dense teacher, as upstream's default --num-experts-teacher 1 builds it (a mixture-of-experts checkpoint is refused
when opened)."""


def open_teacher(config: Config) -> Checkpoint:
    """`--load-teacher`'s checkpoint, or a one-line CheckpointError naming the flag."""
    path = config.distillation.load_teacher
    assert path, "check_teacher runs with --kd, which needs --load-teacher"
    try:
        return open_checkpoint(path)
    except CheckpointError as err:
        text = str(err)
        for prefix in (f"--load {path}: ", f"--load {path.rstrip('/')}: ", f"{os.path.abspath(path)}: "):
            text = text.removeprefix(prefix)  # the path is named once, after the flag
        text = text.replace(", then --load OUT", ", then --load-teacher OUT")  # another trainer's checkpoint
        raise CheckpointError(f"--load-teacher {path}: {text}") from None


def teacher_model(config: Config, ckpt: Checkpoint) -> ModelConfig:
    """The teacher's architecture: the student's with the checkpoint's sizes, checked against both (one-line
    CheckpointError naming the flag or field, both values and the fix)."""
    where = f"--load-teacher {config.distillation.load_teacher} ({ckpt.tag})"
    saved = ckpt.config.model
    for field, flag, given_field in TEACHER_SIZES:
        given, stored = getattr(config.distillation, given_field), getattr(saved, field)
        if given is not None and given != stored:
            raise CheckpointError(
                f"{flag} {given} disagrees with {where}, whose model has {field} {stored}; use {flag} {stored} "
                f"(or drop it: the checkpoint's is taken)"
            )
    teacher = dataclasses.replace(config.model, **{f: getattr(saved, f) for f in OWN_FIELDS})
    ours, theirs = dataclasses.asdict(teacher), dataclasses.asdict(saved)
    free = WEIGHT_FREE_FIELDS + (("max_position_embeddings",) if not teacher.add_position_embedding else ())
    differ = [
        f"{k} {theirs[k]!r} (teacher) vs {v!r} (student)" for k, v in ours.items() if theirs[k] != v and k not in free
    ]
    if differ:
        raise CheckpointError(
            f"{where} differs from the student beyond its layers, width and heads: {'; '.join(differ)}; "
            "Megatron-DeepSpeed builds the teacher from the student's model flags, so give the student the "
            f"teacher's values (or another --load-teacher){vocabulary_hint(ckpt.config, config)}"
        )
    return teacher


def check_sharding(config: Config, teacher: ModelConfig) -> None:
    """At T > 1 the teacher is tensor-parallel like the student: T must divide its heads and MLP width."""
    where = f"--load-teacher {config.distillation.load_teacher}"
    t = config.parallel.tensor_model_parallel_size
    for what, value in (("attention heads", teacher.num_attention_heads), ("MLP width", teacher.ffn_hidden_size)):
        if value % t:
            raise CheckpointError(
                f"{where}: the teacher's {what} {value} is not divisible by --tensor-model-parallel-size {t}, and "
                f"the teacher is tensor-parallel like the student; use a tensor-parallel size that divides {value}"
            )
