"""The command line of `pretrain_gpt.py`: the argparse parser, generated from `megatron_ds.flags`.

`parse_config(argv)` returns `(Config, Namespace)`. Every flag comes from its one declaration in
`megatron_ds.flags` (values, default, help, status); a refused flag is recorded while parsing and
reported with its reason in one line (several refused flags together), an undeclared one is
"unrecognized". `megatron_ds.flags.to_config` then maps the Namespace onto the config tree, which
checks itself. Every user error is a `ConfigError` naming the flag, the value and the fix, raised
before any process group exists.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from typing import Any

from megatron_ds.config import Config, ModelConfig
from megatron_ds.errors import ConfigError
from megatron_ds.estimate.machine import Machine
from megatron_ds.flags import checkpoint_args, compat
from megatron_ds.flags.declare import NO_OP, REFUSED, Flag
from megatron_ds.flags.registry import FLAGS
from megatron_ds.flags.to_config import build_config, model_config_of

__all__ = ["ConfigError", "build_parser", "parse_config"]


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message}; see `python {self.prog} --help`")


class _Refused(argparse.Action):
    """Records a refused Megatron-DeepSpeed flag; `parse_config` reports all of them in one line."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        namespace.refused_flags = *getattr(namespace, "refused_flags", ()), option_string


def _help(f: Flag) -> str:
    """The `--help` line: the declaration's text, its default, the config field it sets."""
    if f.hidden or f.status == REFUSED:
        return argparse.SUPPRESS
    text = f.help
    default = f.resolved_default()
    if f.takes_value and default not in (None, (), False):
        text += f" (default: {default})"
    if f.fields:
        text += f" [sets {', '.join(f.fields)}]"
    return text.replace("%", "%%")


def _argparse_kwargs(f: Flag) -> dict[str, Any]:
    """add_argument keywords for one declaration."""
    kw: dict[str, Any] = {"help": _help(f), "dest": f.attr}
    if f.status == REFUSED:
        return {**kw, "action": _Refused, "nargs": f.nargs}
    if f.status == NO_OP:
        if f.is_switch:
            return {**kw, "action": "store_true"}
        return {**kw, "nargs": f.nargs}
    kw["default"] = f.resolved_default()
    if f.is_switch:
        return {**kw, "action": "store_const", "const": f.const}
    if f.nargs is not None:
        kw["nargs"] = f.nargs
    if f.nargs == "?":
        kw["const"] = f.const
    if f.type is not None:
        kw["type"] = f.type
    choices = f.argparse_choices()
    if choices is not None:
        kw["choices"] = choices
    return kw


FINETUNE_ENTRY = "finetune_llama.py"
"""The entry point that is pretrain_gpt.py with `--prompt-data`: its `--help` and argparse errors name it."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of every declared flag, grouped in `--help` by Megatron-DeepSpeed's groups."""
    finetune = os.path.basename(sys.argv[0]) == FINETUNE_ENTRY
    p = _Parser(
        prog=FINETUNE_ENTRY if finetune else "pretrain_gpt.py",
        description="supervised fine-tuning on a JSON of instruction examples (pretrain_gpt.py --prompt-data)"
        if finetune
        else "GPT pretraining on DeepSpeed's pipeline engine",
        allow_abbrev=False,
    )
    groups: dict[str, Any] = {}
    exclusive: dict[str, Any] = {}
    for f in FLAGS:
        group = groups.get(f.group) or groups.setdefault(f.group, p.add_argument_group(f.group))
        if f.exclusive is not None:
            group = exclusive.get(f.exclusive) or exclusive.setdefault(
                f.exclusive, group.add_mutually_exclusive_group()
            )
        group.add_argument(f.name, *f.aliases, **_argparse_kwargs(f))
    p.set_defaults(refused_flags=())
    return p


def parse_config(
    argv: Sequence[str] | None = None, world_size: int | None = None, machine: Machine | None = None
) -> tuple[Config, argparse.Namespace]:
    """Parse and validate; raises ConfigError with a one-line message on bad input. `machine` (what
    `megatron_ds.training.machine.probe` reads) adds the checks that depend on the device."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.refused_flags:
        raise ConfigError(compat.refused_flags_message(list(args.refused_flags)))
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    checkpoint_args.apply(args, given_dests(parser, argv))
    return build_config(args, world_size, machine), args


def given_dests(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The argparse dests `argv` gives explicitly (a flag at its default value counts as given)."""
    unset = object()
    namespace = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != "help"})
    parsed, _ = parser.parse_known_args(argv, namespace=namespace)
    return {dest for dest, value in vars(parsed).items() if value is not unset}


@functools.lru_cache(maxsize=256)
def model_config(argv: tuple[str, ...]) -> ModelConfig:
    """The ModelConfig pretrain_gpt.py builds from these model flags (and `--tensor-model-parallel-size`,
    which pads the vocabulary): the planner's models are sized by the same declarations and rules.
    Raises ConfigError for an unknown flag or a bad value."""
    args, unknown = build_parser().parse_known_args(list(argv))
    if unknown:
        raise ConfigError(f"unrecognized arguments: {' '.join(unknown)}")
    return model_config_of(args)
