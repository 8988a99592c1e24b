"""What a mixture-of-experts model may train with, as pretrain_gpt.py decides it: its refusals and the expert-parallel
sizes the planner tries.

A model with experts (`ModelConfig.is_moe`: `--num-experts` above 1 on some layer) trains at tensor size 1, at pipeline
size 1 on DeepSpeed's plain engine with ZeRO 0-2 and at a pipeline size the flags fix on its pipeline engine with ZeRO
0/1 (docs/training.md); every rule is `Config._check_experts`'s (config/tree.py),
asked here through a config tree of the configuration in question, so the planner never restates one.
"""

from __future__ import annotations

from megatron_ds.config import (
    Config,
    DistillationConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
)
from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.errors import ConfigError

MOE_ZERO_STAGES = (0, 1, 2)
"""The ZeRO stages a mixture-of-experts plan tries (Config refuses ZeRO-3; offload is not planned for it)."""


def refusal(
    model: ModelConfig,
    tp: int = 1,
    pp: int = 1,
    world: int | None = None,
    zero: int = 0,
    ep: int = 1,
    distillation: DistillationConfig | None = None,
    checkpoint_activations: bool = False,
    schedule: str = DEFAULT_PIPELINE_SCHEDULE,
) -> str | None:
    """pretrain_gpt.py's one-line refusal of this configuration (None: it trains), asked of a config tree: a
    mixture-of-experts model's rules, and with `distillation` the rules of distilling into it. The printed command
    passes `--create-moe-param-group` wherever a model with experts needs it, so that rule is met here."""
    world = world or tp * pp * ep
    try:
        Config(
            model=model,
            parallel=ParallelConfig(
                pipeline_model_parallel_size=pp,
                tensor_model_parallel_size=tp,
                world_size=world,
                expert_parallel_size=ep,
                pipeline_schedule=schedule,
            ),
            training=TrainingConfig(
                zero_stage=zero,
                global_batch_size=max(1, world // (tp * pp)),
                checkpoint_activations=checkpoint_activations,
            ),
            optimizer=OptimizerConfig(create_moe_param_group=model.is_moe),
            distillation=distillation or DistillationConfig(),
        )
    except ConfigError as e:
        return str(e)
    return None


def expert_parallel_sizes(
    model: ModelConfig, num_gpus: int, fixed: int | None = None, teacher: ModelConfig | None = None
) -> list[int]:
    """The expert-parallel sizes a plan on `num_gpus` GPUs (all data-parallel) may use: `fixed` when given, else
    every divisor of the GPU count and of every expert count, the student's and a mixture-of-experts `teacher`'s
    (which shares out its experts over the same groups: `training/checkpoint/teacher.check_experts`), smallest first."""
    if fixed is not None:
        return [fixed]
    layers = model.experts_per_layer + (teacher.experts_per_layer if teacher is not None else ())
    counts = [n for n in layers if n > 1]
    return [e for e in range(1, num_gpus + 1) if num_gpus % e == 0 and all(n % e == 0 for n in counts)]
