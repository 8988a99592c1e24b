"""The planner's sections, one registry: each one's name, the inputs it needs, its builder and help.

The command line draws everything about a section from `SECTIONS`: the COMMAND choices, the
lines of `--help`, the `all` run (every `in_default` section, in this order; the long guides only
when named) and the check that the inputs a
section needs were given (asked for as questions otherwise, `inputs.QUESTIONS`). Adding a section
is one entry here plus its builder `(Context) -> Section`; docs/planner.md lists the commands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_ds.plan import memory_advice, nvme, onebit, pipeline_plan, precision, sparse_attention, zero
from megatron_ds.plan.context import Context
from megatron_ds.plan.report import Section

ALL = "all"
"""The command that runs every section (also what runs without a command)."""


@dataclass(frozen=True)
class PlannerSection:
    """One sub-command of `python -m megatron_ds.plan` and the section of the report it builds."""

    name: str
    """The COMMAND that runs it alone; also `Section.name` in the JSON report."""
    needs: tuple[str, ...]
    """Inputs checked before it runs (keys of `inputs.QUESTIONS`); a missing one is asked for."""
    build: Callable[[Context], Section]
    """Builds the section; raises PlanError (a one-line user error) when it cannot answer."""
    help: str
    """One line for `--help` (short: `--help` keeps to 80 columns)."""
    in_default: bool = True
    """Run without a COMMAND (`all`); False: a guide that runs only when its COMMAND is given."""


_FLEET = ("model", "num_gpus", "gpu_memory")  # a model on a known number of GPUs of known memory

SECTIONS: tuple[PlannerSection, ...] = (
    PlannerSection("zero", _FLEET, zero.zero_section, "model-state memory per GPU for every ZeRO stage"),
    PlannerSection("precision", ("compute_capability",), precision.precision_section, "fp16, bf16 or fp8 for this GPU"),
    PlannerSection(
        "pipeline",
        (*_FLEET, "global_batch_size", "precision"),
        pipeline_plan.pipeline_section,
        "degrees, layout, memory and time per stage, JSON, command",
    ),
    PlannerSection(
        "memory",
        (*_FLEET, "global_batch_size", "precision"),
        memory_advice.memory_section,
        "why a stage runs out of memory; changes, cheapest first",
    ),
    PlannerSection("nvme", (), nvme.nvme_section, "DeepNVMe: which handle, the aio block, an example, tuning", False),
    PlannerSection("onebit", (), onebit.onebit_section, "whether 1-bit Adam / 0/1 Adam / 1-bit LAMB would help", False),
    PlannerSection(
        "sparse-attention",
        ("model",),
        sparse_attention.sparse_attention_section,
        "when block-sparse attention helps, whether it runs here",
        False,
    ),
)


def names() -> tuple[str, ...]:
    """The COMMAND choices, in the order `all` runs them."""
    return tuple(s.name for s in SECTIONS)


def selected(command: str) -> tuple[PlannerSection, ...]:
    """The sections `command` runs: one, or every default section for `all`."""
    if command == ALL:
        return tuple(s for s in SECTIONS if s.in_default)
    return tuple(s for s in SECTIONS if s.name == command)


def needs(command: str) -> list[str]:
    """The inputs `command` needs, each once, in the order the sections ask for them."""
    return list(dict.fromkeys(n for s in selected(command) for n in s.needs))


def help_text() -> str:
    """The commands part of `--help`: one line per section."""
    width = max(len(s.name) for s in SECTIONS) + 2
    default = [f"  {s.name:<{width}}{s.help}" for s in SECTIONS if s.in_default]
    guides = [f"  {s.name:<{width}}{s.help}" for s in SECTIONS if not s.in_default]
    return "\n".join(
        ["COMMAND (without one, these run, in this order):", *default, "guides (only when named):", *guides]
    )
