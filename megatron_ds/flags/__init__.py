"""The command line of `pretrain_gpt.py`, in one package: every flag declared once, the parser,
flags -> config, and the refusals and compatibility table. Parsing imports no torch.

    declare.py    `Flag`: one declaration (values, default, status, the config field it sets, help)
    model.py      declarations: network size, mixture of experts, regularization, initialization
    training.py   declarations: training, validation
    lr_precision.py declarations: learning rate, mixed precision
    parallel.py   declarations: distributed (with our pipeline-layout flags), DeepSpeed/ZeRO/recompute
    data_io.py    declarations: data and tokenizer, checkpointing
    logging_flags.py declarations: logging
    megatron_lm.py  declarations: Megatron-LM's flags, spliced into those groups (network size, training,
                  mixed precision, Transformer Engine, distributed), and GROUPS, every table of them
    megatron_lm_io.py declarations: Megatron-LM's data and tokenizer, checkpointing and logging flags
    other_models.py declarations: Megatron-DeepSpeed's groups of its other models (Retro, vision, ...)
    registry.py   FLAGS (all of them, in the compatibility table's order) and BY_NAME
    parser.py     the argparse parser and `--help` drawn from FLAGS; `parse_config(argv)`
    to_config.py  parsed flags -> the config tree (which checks itself), then the layout check
    to_model_config.py  parsed flags -> the model section (sizes, vocabulary, activation)
    lengths.py    training and learning-rate schedule lengths in Megatron's units
    compat.py     refusal messages and docs/compatibility.md's table (`python -m megatron_ds.flags.compat`)

To add a flag, add one declaration to its group's table (see docs/configuration.md). Modules of
this package import each other directly, never this file.
"""

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
from megatron_ds.flags.registry import BY_NAME, FLAGS

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
