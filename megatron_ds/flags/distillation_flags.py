"""Flags -> `DistillationConfig`: Megatron-DeepSpeed's knowledge-distillation group (`--kd`, `--mos` and their
teacher).

What only the command line says: the NOTICEs that `--kd-alpha-ce` scales nothing (Megatron-DeepSpeed reads it into `alpha` and never uses it), that the teacher
runs without the dropout upstream's teacher keeps, and that at T > 1 the kd loss is the full vocabulary's KL
divergence (upstream's is a sum of per-shard ones), and the warning for teacher flags
given without `--kd` (Megatron-DeepSpeed reads them only with it). The teacher's checkpoint is checked against them
with the files, before any process group (`training.distillation.check_teacher`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from megatron_ds.config import DistillationConfig
from megatron_ds.flags.declare import flag_of
from megatron_ds.flags.notices import notice

_TEACHER_FLAGS = (
    "load_teacher",
    "num_layers_teacher",
    "hidden_size_teacher",
    "num_attention_heads_teacher",
    "num_experts_teacher",
)


def distillation_config(
    args: argparse.Namespace, direct: dict[str, Any], warn: Callable[[str], None]
) -> DistillationConfig:
    """The section from its flags (copied as given in `direct`), with the command line's own rules."""
    config = DistillationConfig(**direct)
    if not config.distils:
        given = [d for d in _TEACHER_FLAGS if getattr(args, d) is not None]
        if given:
            warn(f"{', '.join(map(flag_of, given))}: read only with --kd or --mos; ignored without them")
        return DistillationConfig()  # nothing of it is read: the same config as without the flags
    if args.hidden_dropout or args.attention_dropout:
        notice(
            f"{config.flag}: the teacher runs without dropout (eval mode); Megatron-DeepSpeed never puts its teacher in eval "
            f"mode, so its teacher drops activations as the student does (--hidden-dropout {args.hidden_dropout:g}, "
            f"--attention-dropout {args.attention_dropout:g})"
        )
    if (args.tensor_model_parallel_size or 1) > 1:
        notice(
            f"{config.flag} with --tensor-model-parallel-size {args.tensor_model_parallel_size}: the kd loss is the full "
            "vocabulary's KL divergence (the softmax's maximum and sums all-reduced over the tensor group); "
            "Megatron-DeepSpeed takes the softmax over each rank's vocabulary shard, so its kd loss is a sum of "
            "per-shard KL divergences"
        )
    if config.kd_alpha_ce != 1.0:
        notice(
            f"--kd-alpha-ce {config.kd_alpha_ce:g} scales nothing: Megatron-DeepSpeed reads it and never uses it "
            "(its loss is lm loss + kd loss); --kd-beta-ce scales the kd loss"
        )
    return config
