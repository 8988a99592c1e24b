"""Megatron-DeepSpeed compatibility, rendered from the flag declarations (`megatron_ds.flags`).

The refusal messages (a refused flag, or a refused value of an accepted flag) and the
compatibility table (`python -m megatron_ds.flags.compat` prints it; a test keeps docs/compatibility.md's
copy equal to it) are both drawn from `megatron_ds.flags.FLAGS`, so neither can disagree with
what the parser does. Flags Megatron-DeepSpeed does not have (ours, `Flag.megatron` False)
are left out of the table; Megatron flags not declared are "unrecognized arguments".

Pure data and string functions: no torch, no argparse.
"""

from __future__ import annotations

from megatron_ds.flags.declare import REFUSED, Flag
from megatron_ds.flags.registry import BY_NAME, FLAGS


def refusal_message(name: str, value: str | None = None) -> str:
    """The one-line message for a refused flag, or for a refused value of an accepted flag."""
    f = BY_NAME[name]
    if value is None:
        assert f.status == REFUSED, name
        return f"{name} is not supported: {f.help}; {f.fix}"
    refusal = next(r for r in f.refused_values if r.value == value)
    return f"{name} {value} is not supported: {refusal.reason}; {refusal.fix}"


def refused_flags_message(names: list[str]) -> str:
    """One line for one or more refused flags, in the order given."""
    return " | ".join(refusal_message(n) for n in dict.fromkeys(names))


def refused_value(flag: Flag, value: object) -> str | None:
    """The refusal message if `value` (as parsed) is a refused value of `flag`, else None."""
    if any(str(value) == r.value for r in flag.refused_values):
        return refusal_message(flag.name, str(value))
    return None


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """The compatibility table (docs/compatibility.md): every Megatron-DeepSpeed flag, grouped as Megatron-DeepSpeed groups them."""
    lines = ["| group | flag | here | meaning, or why not |", "|---|---|---|---|"]
    for f in FLAGS:
        if not f.megatron:
            continue
        note = f"{f.help}; {f.fix}" if f.status == REFUSED and f.fix else f.help
        if f.refused_values:
            note = f"{note} (refused: {', '.join(f'`{r.value}`' for r in f.refused_values)})"
        lines.append(f"| {f.group} | `{f.name}` | {f.status} | {_cell(note)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
