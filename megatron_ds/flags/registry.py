"""All flag declarations in one tuple, in the compatibility table's order (Megatron-DeepSpeed's
argument groups), and the lookup by spelling."""

from __future__ import annotations

import megatron_ds.flags.data_io as data_io
import megatron_ds.flags.logging_flags as logging_flags
import megatron_ds.flags.lr_precision as lr_precision
import megatron_ds.flags.megatron_lm as megatron_lm
import megatron_ds.flags.megatron_lm_io as megatron_lm_io
import megatron_ds.flags.megatron_lm_moe as megatron_lm_moe
import megatron_ds.flags.model as model
import megatron_ds.flags.other_models as other_models
import megatron_ds.flags.parallel as parallel
import megatron_ds.flags.training as training
from megatron_ds.flags.declare import Flag

FLAGS: tuple[Flag, ...] = (
    *model.NETWORK,
    *megatron_lm.NETWORK,
    *model.MIXTURE_OF_EXPERTS,
    *megatron_lm_moe.MIXTURE_OF_EXPERTS,
    *logging_flags.LOGGING,
    *megatron_lm_io.LOGGING,
    *model.REGULARIZATION,
    *training.TRAINING,
    *megatron_lm.TRAINING,
    *model.INITIALIZATION,
    *lr_precision.LEARNING_RATE,
    *data_io.CHECKPOINTING,
    *megatron_lm_io.CHECKPOINTING,
    *lr_precision.MIXED_PRECISION,
    *megatron_lm.MIXED_PRECISION,
    *megatron_lm.TRANSFORMER_ENGINE,
    *parallel.DISTRIBUTED,
    *megatron_lm.DISTRIBUTED,
    *training.VALIDATION,
    *data_io.DATA,
    *megatron_lm_io.DATA,
    *parallel.DEEPSPEED,
    *(f for group in other_models.GROUPS for f in group),
)
"""All flags, in the compatibility table's order (Megatron-DeepSpeed's groups, each followed by the
Megatron-LM flags of that group)."""

BY_NAME: dict[str, Flag] = {name: f for f in FLAGS for name in (f.name, *f.aliases)}
assert len(BY_NAME) == sum(1 + len(f.aliases) for f in FLAGS), "a flag is declared twice"
