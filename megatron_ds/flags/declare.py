"""How one command-line flag is declared (`Flag`), and the short constructors the tables use.

A declaration says everything about a flag once: its name and values (type, nargs, default,
choices), its status here (accepted, a no-op with the reason, or refused with the reason and the
fix, or a refused *value* of an accepted flag), the config field(s) it sets, and its help text.
`megatron_ds.flags.parser` builds the argparse parser from the declarations, `megatron_ds.flags.to_config`
copies the directly-mapped values into the config tree, and `megatron_ds.flags.compat` renders the
refusals and the compatibility table (docs/compatibility.md). Pure data: no argparse, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_ds.config.tree import SECTIONS

ACCEPTED, NO_OP, REFUSED = "accepted", "no-op", "refused"
SWITCH, VALUE, VALUES = 0, "?", "*"
"""What a no-op or refused flag consumes, as argparse nargs: nothing, one value, any number."""
MEGATRON_LM = "Megatron-LM's flag"
"""How the help of a flag Megatron-DeepSpeed lacks and Megatron-LM has begins."""


class _FieldDefault:
    def __repr__(self) -> str:
        return "FIELD_DEFAULT"


FIELD_DEFAULT: Any = _FieldDefault()
"""A flag's default when not given explicitly: the default of the config field it sets (so the
two cannot drift), None for a value flag without a field, False for a switch."""


@dataclass(frozen=True)
class Refusal:
    """A value of an accepted flag that is refused: why, and what to do instead."""

    value: str
    reason: str
    fix: str


@dataclass(frozen=True)
class Flag:
    """One command-line flag of `pretrain_gpt.py`."""

    name: str
    """The option string, e.g. `--hidden-size`."""
    group: str
    """Megatron-DeepSpeed's argument group (`megatron/arguments.py`); `--help` groups by it."""
    status: str
    """ACCEPTED (the meaning in `help`), NO_OP (accepted, changes nothing: `help` says why) or REFUSED."""
    help: str
    """What the flag does here (ACCEPTED), why nothing changes (NO_OP), or why not (REFUSED)."""
    fix: str = "drop it"
    """REFUSED only: what to do instead."""
    nargs: int | str | None = None
    """argparse nargs: None for one value, 0 for a switch, or `?`, `*`, `+`."""
    type: type | None = None
    """Converter of each value (int, float); None keeps the string."""
    default: Any = FIELD_DEFAULT
    const: Any = True
    """The value a switch stores (False for `--no-...` switches), or a bare `nargs="?"` flag's value."""
    choices: tuple[Any, ...] | None = None
    """Accepted values (refused values are added to argparse's choices and refused with their reason)."""
    dest: str | None = None
    """The Namespace attribute; by default the name without dashes, as argparse derives it."""
    aliases: tuple[str, ...] = ()
    """Other spellings (Megatron's older names)."""
    fields: tuple[str, ...] = ()
    """The config fields (`section.field`) the flag sets."""
    derived: bool = False
    """True: `to_config.py` (a model field: `to_model_config.py`) computes the field(s) from this and other flags (defaults that depend on
    other flags, unit conversions). False: the value is copied into its one field as given."""
    refused_values: tuple[Refusal, ...] = ()
    exclusive: str | None = None
    """Flags sharing this key are mutually exclusive (`--fp16`, `--bf16`)."""
    megatron: bool = True
    """A Megatron-DeepSpeed flag (a row of the compatibility table); False for ours."""
    hidden: bool = False
    """Left out of `--help` (set by launchers)."""

    @property
    def attr(self) -> str:
        """The argparse dest."""
        return self.dest or self.name.lstrip("-").replace("-", "_")

    @property
    def is_switch(self) -> bool:
        return self.nargs == 0

    @property
    def takes_value(self) -> bool:
        return not self.is_switch

    def resolved_default(self) -> Any:
        """The argparse default (see FIELD_DEFAULT)."""
        if self.default is not FIELD_DEFAULT:
            return self.default
        if self.fields and not self.derived:
            return field_default(self.fields[0])
        return False if self.is_switch else None

    def argparse_choices(self) -> tuple[Any, ...] | None:
        """Accepted choices plus the refused values (converted by `type`), or None."""
        if self.choices is None and not self.refused_values:
            return None
        refused = tuple((self.type or str)(r.value) for r in self.refused_values)
        return (*(self.choices or ()), *refused)


def flag_of(dest: str) -> str:
    """The flag spelling of an argparse dest: `train_iters` -> `--train-iters`."""
    return "--" + dest.replace("_", "-")


def field_default(path: str) -> Any:
    """The default of config field `section.field`."""
    section, name = path.split(".")
    f = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
    assert f.default is not dataclasses.MISSING, f"{path} has no default; give the flag an explicit default"
    return f.default


def accepted(name: str, group: str, help: str, field: str | None = None, **kw: Any) -> Flag:
    """An accepted flag taking a value; `field` is the one config field it is copied into."""
    fields = kw.pop("fields", (field,) if field else ())
    return Flag(name, group, ACCEPTED, help, fields=fields, **kw)


def switch(name: str, group: str, help: str, field: str | None = None, stores: bool = True, **kw: Any) -> Flag:
    """An accepted flag without a value; it stores `stores` (False for `--no-...`)."""
    fields = kw.pop("fields", (field,) if field else ())
    return Flag(name, group, ACCEPTED, help, nargs=0, const=stores, fields=fields, **kw)


def no_op(name: str, group: str, reason: str, takes: int | str = SWITCH, aliases: tuple[str, ...] = ()) -> Flag:
    """A Megatron-DeepSpeed flag accepted here that changes nothing; `reason` says why."""
    return Flag(name, group, NO_OP, reason, nargs=takes, aliases=aliases)


def refused(name: str, group: str, reason: str, fix: str = "drop it", takes: int | str = SWITCH) -> Flag:
    """A Megatron-DeepSpeed flag refused with a one-line error: `reason`, then `fix`."""
    return Flag(name, group, REFUSED, reason, fix=fix, nargs=takes)
