"""The teacher of knowledge distillation (`--kd`, `--mos`) by its checkpoint's metadata alone (no torch): which
checkpoint `--load-teacher` names, the teacher's architecture (its own sizes and experts from its saved config, the
`--*-teacher` flags agreeing, the rest the student's) and the tensor- and expert-parallel split it must allow.
`training/distillation.py` loads it from these; the planner sizes it from them (`plan/distillation.py`), so both give
the same one-line errors."""

from __future__ import annotations

import dataclasses
import os

from megatron_ds.config import Config, ModelConfig
from megatron_ds.config.experts import MOE_ROUTING_FIELDS, SHARED_EXPERT_FIELDS, experts_per_layer
from megatron_ds.training.checkpoint.directory import UNIVERSAL_FORMAT, CheckpointError
from megatron_ds.training.checkpoint.opening import Checkpoint, open_checkpoint
from megatron_ds.training.checkpoint.rules import WEIGHT_FREE_FIELDS, vocabulary_hint

TEACHER_SIZES = (
    ("num_layers", "--num-layers-teacher", "num_layers_teacher"),
    ("hidden_size", "--hidden-size-teacher", "hidden_size_teacher"),
    ("num_attention_heads", "--num-attention-heads-teacher", "num_attention_heads_teacher"),
)
"""(ModelConfig field, flag, DistillationConfig field): what upstream swaps into the student's args (and
`--num-experts-teacher`, compared as experts per layer: `_check_experts_flag`)."""
OWN_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "kv_channels",  # its head size, as its hidden size / heads when not given (the NOTICE of `check_teacher`)
    "ffn_hidden_size",
    "num_experts",
    "expert_interval",
    "mlp_type",
    *SHARED_EXPERT_FIELDS,
    *MOE_ROUTING_FIELDS,
)
"""The teacher's own sizes, read from its checkpoint, and its MLPs: dense, or its experts per layer, PR-MoE's residual
MLP, Megatron-LM's shared expert and how its gates route (top-k, capacity factors, minimum capacity, token dropping, 2nd-expert sampling) as it was
trained. Megatron-DeepSpeed routes its teacher with the student's MoE flags instead: `routing_notice`."""
TEACHER_ROUTING = (
    "moe_top_k",
    "moe_train_capacity_factor",
    "moe_min_capacity",
    "moe_token_dropping",
    "moe_top2_2nd_expert_sampling",
)
"""The routing fields a teacher's forward reads (its eval capacity factor and loss coefficient are unused:
`training/distillation.py` runs its gates at the train capacity factor and adds no load-balancing loss)."""


def open_teacher(config: Config) -> Checkpoint:
    """`--load-teacher`'s checkpoint, or a one-line CheckpointError naming the flag."""
    path = config.distillation.load_teacher
    assert path, "check_teacher runs with --kd, which needs --load-teacher"
    try:
        ckpt = open_checkpoint(path, moe=True)  # a mixture-of-experts teacher: its experts by global index
    except CheckpointError as err:
        text = str(err)
        for prefix in (f"--load {path}: ", f"--load {path.rstrip('/')}: ", f"{os.path.abspath(path)}: "):
            text = text.removeprefix(prefix)  # the path is named once, after the flag
        text = text.replace(", then --load OUT", ", then --load-teacher OUT")  # another trainer's checkpoint
        raise CheckpointError(f"--load-teacher {path}: {text}") from None
    if ckpt.config.model.is_moe and ckpt.meta.get("format") == UNIVERSAL_FORMAT:
        raise CheckpointError(
            f"--load-teacher {path}: a universal checkpoint (training state, no per-expert weight files); give the "
            "checkpoint it was converted from, or resume it with pretrain_gpt.py --load and --save a regular one"
        )
    return ckpt


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
    _check_experts_flag(config, saved, where)
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


def _check_experts_flag(config: Config, saved: ModelConfig, where: str) -> None:
    """`--num-experts-teacher`, when given, gives the checkpoint's experts per layer (one count for every
    mixture-of-experts layer or one per such layer, as `--num-experts`; 1: a dense teacher)."""
    given = config.distillation.num_experts_teacher
    if given is None:
        return
    groups = saved.num_layers // saved.expert_interval
    ours = experts_per_layer(given, saved.num_layers, saved.expert_interval) if len(given) in (1, groups) else None
    if ours != saved.experts_per_layer:
        flag = f"--num-experts-teacher {' '.join(map(str, given))}"
        stored = " ".join(map(str, saved.num_experts))
        raise CheckpointError(
            f"{flag} disagrees with {where}, whose model has --num-experts {stored} (experts per layer "
            f"{list(saved.experts_per_layer)}); use --num-experts-teacher {stored} (or drop it: the checkpoint's is "
            "taken)"
        )


def check_experts(config: Config, teacher: ModelConfig) -> None:
    """A mixture-of-experts teacher shares the student's expert-parallel groups (`--moe-expert-parallel-size` E, which
    `Config` has checked against the data-parallel size): E must divide each of its expert counts; its MoE layers are
    not tensor-parallel here and run beside a ZeRO-0-2 student (one-line CheckpointError, before any collective)."""
    if not teacher.is_moe:
        return
    where = f"--load-teacher {config.distillation.load_teacher}"
    experts = f"--num-experts {' '.join(map(str, teacher.num_experts))}"
    ep = config.parallel.expert_parallel_size
    uneven = sorted({n for n in teacher.experts_per_layer if n > 1 and n % ep})
    for ok, why in (
        (
            not uneven,
            f"--moe-expert-parallel-size {ep} does not divide its {uneven[0] if uneven else 0} experts, and it shares "
            "out its experts over the student's expert-parallel groups; choose a --moe-expert-parallel-size that "
            "divides every expert count of the student and the teacher",
        ),
        (
            config.parallel.tensor_model_parallel_size == 1,
            f"its MoE layers are not tensor-parallel here, and the student runs at --tensor-model-parallel-size "
            f"{config.parallel.tensor_model_parallel_size}; use --tensor-model-parallel-size 1",
        ),
        (
            config.training.zero_stage < 3,
            f"--zero-stage {config.training.zero_stage} is not run with MoE layers here (DeepSpeed refuses ZeRO-3 with "
            "them); use --zero-stage 0, 1 or 2",
        ),
    ):
        if not ok:
            raise CheckpointError(f"{where}: a mixture-of-experts teacher ({experts}): {why}")


def routing_notice(config: Config, teacher: ModelConfig) -> str | None:
    """The NOTICE of a mixture-of-experts teacher: its gates route as its checkpoint was trained (`OWN_FIELDS`), at
    its train capacity factor, where Megatron-DeepSpeed routes its teacher with the student's MoE flags (in train
    mode: the train capacity factor too). None for a dense teacher, or one whose routing is a MoE student's."""
    if not teacher.is_moe:
        return None
    student = config.model
    own = [f"{f} {getattr(teacher, f)!r}" for f in TEACHER_ROUTING]
    if student.is_moe:
        own = [
            f"{f} {getattr(teacher, f)!r} (student: {getattr(student, f)!r})"
            for f in TEACHER_ROUTING
            if getattr(teacher, f) != getattr(student, f)
        ]
        if not own:
            return None
    return (
        f"NOTICE: --load-teacher {config.distillation.load_teacher}: the mixture-of-experts teacher routes tokens as "
        f"its checkpoint was trained ({'; '.join(own)}), its gates at the train capacity factor; Megatron-DeepSpeed "
        "routes its teacher with the student's MoE flags"
    )
