"""All flag declarations in one tuple, in the compatibility table's order (Megatron-DeepSpeed's
argument groups), and the lookup by spelling."""

from __future__ import annotations

import megatron_ds.flags.data_io as data_io
import megatron_ds.flags.model as model
import megatron_ds.flags.parallel as parallel
import megatron_ds.flags.training as training
from megatron_ds.flags.declare import Flag

FLAGS: tuple[Flag, ...] = (
    *model.NETWORK,
    *model.MIXTURE_OF_EXPERTS,
    *data_io.LOGGING,
    *model.REGULARIZATION,
    *training.TRAINING,
    *model.INITIALIZATION,
    *training.LEARNING_RATE,
    *data_io.CHECKPOINTING,
    *training.MIXED_PRECISION,
    *parallel.DISTRIBUTED,
    *training.VALIDATION,
    *data_io.DATA,
    *parallel.DEEPSPEED,
)
"""All flags, in the compatibility table's order (Megatron-DeepSpeed's groups)."""

BY_NAME: dict[str, Flag] = {name: f for f in FLAGS for name in (f.name, *f.aliases)}
assert len(BY_NAME) == sum(1 + len(f.aliases) for f in FLAGS), "a flag is declared twice"
