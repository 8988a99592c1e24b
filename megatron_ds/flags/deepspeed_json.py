"""Flags whose absence means the DeepSpeed JSON's value, as Megatron-DeepSpeed reads the JSON.

Megatron-DeepSpeed hands `--deepspeed_config` to DeepSpeed, so the JSON's ZeRO stage and gradient
clipping are what trains there. `--zero-stage` and `--clip-grad` absent therefore take the file's
`zero_optimization.stage` and `gradient_clipping`; given, they are written into the JSON and a file
that says otherwise is a contradiction (`training.deepspeed_config.merge`). Without either, our
defaults: ZeRO 0 and Megatron's clip of 1.0, which is written into the JSON too, so a missing
`gradient_clipping` never falls back to the installed DeepSpeed's own default (1.0 in 0.19.8, 0 in
older releases): the same clip whatever release is installed, said by a NOTICE at launch.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_ds.errors import ConfigError
from megatron_ds.training.deepspeed_config import load_user_config

DEFAULTS: dict[str, tuple[tuple[str, ...], Any]] = {
    "zero_stage": (("zero_optimization", "stage"), 0),
    "clip_grad": (("gradient_clipping",), 1.0),
}
"""argparse dest -> (where the JSON holds it, the value when neither the flag nor the file gives it)."""
ZERO_STAGES = (0, 1, 2, 3)


def json_default(args: argparse.Namespace, dest: str) -> Any:
    """The flag's value; absent, the user JSON's (checked), else our default."""
    given = getattr(args, dest)
    if given is not None:
        return given
    keys, default = DEFAULTS[dest]
    path = args.deepspeed_config
    if not path:
        return default
    value: Any = load_user_config(path)
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return default
        value = value[key]
    where = ".".join(keys)
    if dest == "zero_stage" and value not in ZERO_STAGES:
        raise ConfigError(f"--deepspeed_config {path} sets {where} {value!r}; ZeRO stages are 0, 1, 2 and 3")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"--deepspeed_config {path} sets {where} {value!r}; give a number >= 0")
    return value
