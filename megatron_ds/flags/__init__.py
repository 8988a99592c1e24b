"""Every command-line flag of `pretrain_gpt.py`, declared once (`declare.Flag`).

One declaration per flag gives its values, default, status (accepted, no-op with the reason,
refused with the reason and the fix, refused values), the config field it sets and its help;
from this table come the argparse parser and `--help` (`megatron_ds.arguments`), the copy of
values into the config tree (`megatron_ds.validation`), the refusal messages and the compatibility
table of docs/compatibility.md (`megatron_ds.compat`, `python -m megatron_ds.compat`).

The tables, by Megatron-DeepSpeed's argument groups:
    model.py      network size, mixture of experts, regularization, initialization
    training.py   training, learning rate, mixed precision, validation
    parallel.py   distributed (with our pipeline-layout flags), DeepSpeed/ZeRO/recompute
    data_io.py    data and tokenizer, checkpointing, logging

To add a flag, add one declaration to its group's table (see docs/configuration.md).
"""

from __future__ import annotations

from megatron_ds.flags import data_io, model, parallel, training
from megatron_ds.flags.declare import (
    ACCEPTED,
    FIELD_DEFAULT,
    NO_OP,
    REFUSED,
    SWITCH,
    VALUE,
    VALUES,
    Flag,
    Refusal,
)

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

__all__ = [
    "ACCEPTED",
    "BY_NAME",
    "FIELD_DEFAULT",
    "FLAGS",
    "NO_OP",
    "REFUSED",
    "SWITCH",
    "VALUE",
    "VALUES",
    "Flag",
    "Refusal",
]
