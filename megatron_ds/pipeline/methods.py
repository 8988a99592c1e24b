"""The partition methods of `--pp-partition-method`: one registry entry per method.

An entry is the method's name, a one-line summary (the `--help` text and the table in
docs/layouts.md are generated from it), the costs it needs from its caller, and the function
that computes the transformer layers per stage. The layout engine measures nothing itself: a
caller that knows the model (`megatron_ds.estimate.run_layout`, the planner) reads `needs` and
passes those costs in a `Costs`. Adding a method is one entry in `REGISTRY` plus its function.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_ds.errors import LayoutError
from megatron_ds.pipeline import partition
from megatron_ds.pipeline.balance import balanced_counts
from megatron_ds.pipeline.costs import StageCost, StageTimeFn, StepTimeFn
from megatron_ds.pipeline.fastest import fastest_counts
from megatron_ds.pipeline.specs import SpecGroups

FLAG = "--pp-partition-method"
DEFAULT_METHOD = "type:transformer"  # DeepSpeed's stock choice (Megatron-DeepSpeed hard-codes it)


@dataclass(frozen=True)
class Costs:
    """What the caller supplies for the methods that need it; each field name is one need."""

    spec_weights: Sequence[float] | None = None
    """One weight per layer spec, in spec order (parameter counts, `model/naming.py`)."""
    stage_memory: StageCost | None = None
    """`cost(stage, num_layers) -> bytes` for the stage count at hand (`estimate/memory_model.py`)."""
    stage_time: StageTimeFn | None = None
    """`time(stage, num_layers) -> StageTime` from the compute model's FLOPs (`estimate/compute.py`)."""
    measured_stage_time: StageTimeFn | None = None
    """The same, from timing each group once in this process (`estimate/calibrate.py`)."""
    step_time: StepTimeFn | None = None
    """The run's pipeline-schedule step of a split from its stages' times (`estimate/step_simulator.step_estimator`)."""
    memory_limit: float | None = None
    """Bytes every stage must fit in (`--pp-memory-limit`, default the GPU's memory)."""
    max_visits: int | None = None
    """Not a need: a caller's limit on the exact search's work (`fastest.SearchBudgetError` past it; the
    planner's refinement sets it, a run does not)."""


SPEC_WEIGHTS = "spec_weights"
STAGE_MEMORY = "stage_memory"
STAGE_TIME = "stage_time"
MEASURED_STAGE_TIME = "measured_stage_time"
STEP_TIME = "step_time"
MEMORY_LIMIT = "memory_limit"
NEED_DOCS = {
    SPEC_WEIGHTS: "parameters per layer spec",
    STAGE_MEMORY: "predicted stage memory (memory model)",
    STAGE_TIME: "predicted stage time (compute model FLOPs)",
    MEASURED_STAGE_TIME: "measured stage time (each group timed once in this process)",
    STEP_TIME: "the pipeline schedule's step of a split (schedule simulator)",
    MEMORY_LIMIT: "--pp-memory-limit (default: the GPU's memory)",
}
TIME_NEEDS = (STAGE_TIME, MEASURED_STAGE_TIME)

# (groups, num_stages, the method as spelled, costs) -> transformer layers per stage
CountsFn = Callable[[SpecGroups, int, str, Costs], list[int]]


@dataclass(frozen=True)
class PartitionMethod:
    """One `--pp-partition-method` value, or a family of them (a name ending in ':')."""

    name: str
    syntax: str
    """How it is written in help and errors, e.g. `type:REGEX or type:NAME:WEIGHT|NAME:WEIGHT`."""
    summary: str
    counts: CountsFn
    needs: tuple[str, ...] = ()
    """Fields of `Costs` the caller must fill."""
    layout_alias: str | None = None
    """A `--pp-layout` value that means this method (`auto` for memory)."""
    planned: bool = False
    """The planner (`python -m megatron_ds.plan --layout`) compares it with the dedicated modes."""

    def matches(self, method: str) -> bool:
        return method.startswith(self.name) if self.name.endswith(":") else method == self.name

    @property
    def needs_stage_memory(self) -> bool:
        return STAGE_MEMORY in self.needs

    @property
    def needs_stage_time(self) -> bool:
        return any(n in self.needs for n in TIME_NEEDS)


def _parts_to_counts(groups: SpecGroups, parts: list[int], method: str) -> list[int]:
    """Layers per stage from DeepSpeed `parts` over all specs; a middle stage without a layer is an error."""
    counts = groups.layer_counts(parts)
    empty = [i for i in range(1, len(counts) - 1) if counts[i] == 0]
    if empty:
        raise LayoutError(
            f"{FLAG} {method} splits --num-layers {groups.num_layers} over {len(counts)} stages "
            f"(--pipeline-model-parallel-size, times --num-virtual-stages-per-pipeline-rank if given) leaving stage(s) "
            f"{', '.join(map(str, empty))} without a transformer layer; use fewer stages, "
            f"more layers, or --pp-dedicated-embedding-stages"
        )
    return counts


def _uniform(groups: SpecGroups, num_stages: int, method: str, costs: Costs) -> list[int]:
    return _parts_to_counts(groups, partition.uniform(groups.num_specs, num_stages), method)


def _parameters(groups: SpecGroups, num_stages: int, method: str, costs: Costs) -> list[int]:
    weights = [float(w) for w in costs.spec_weights or ()]
    assert len(weights) == groups.num_specs, "the parameters method needs one weight per spec"
    return _parts_to_counts(groups, partition.balanced(weights, num_stages), method)


def _memory(groups: SpecGroups, num_stages: int, method: str, costs: Costs) -> list[int]:
    assert costs.stage_memory is not None
    return balanced_counts(groups.num_layers, num_stages, costs.stage_memory, method)


def _fastest(groups: SpecGroups, num_stages: int, method: str, costs: Costs) -> list[int]:
    return _fastest_with(groups, num_stages, method, costs, costs.stage_time)


def _profile(groups: SpecGroups, num_stages: int, method: str, costs: Costs) -> list[int]:
    return _fastest_with(groups, num_stages, method, costs, costs.measured_stage_time)


def _fastest_with(
    groups: SpecGroups, num_stages: int, method: str, costs: Costs, stage_time: StageTimeFn | None
) -> list[int]:
    assert stage_time is not None and costs.stage_memory is not None and costs.step_time is not None
    assert costs.memory_limit is not None
    return fastest_counts(
        groups.num_layers,
        num_stages,
        stage_time,
        costs.stage_memory,
        costs.memory_limit,
        step_time=costs.step_time,
        method=method,
        max_visits=costs.max_visits,
    )


def _types(groups: SpecGroups, num_stages: int, method: str, costs: Costs) -> list[int]:
    return _parts_to_counts(groups, partition.balanced(type_weights(groups.names, method), num_stages), method)


def type_weights(names: Sequence[str], method: str) -> list[float]:
    """Per-spec weights of `type:REGEX` (1 where the name matches) or `type:NAME:W|NAME:W`
    (W where NAME matches, the first matching term wins); case-insensitive, as DeepSpeed."""
    flag = f"{FLAG} {method}"
    body = method[len("type:") :]
    weighted = [re.fullmatch(r"(.+):([-+0-9.eE]+)", t) for t in body.split("|")]
    terms = [(m.group(1), _weight(m.group(2), flag)) for m in weighted] if all(weighted) else [(body, 1.0)]
    weights = [0.0] * len(names)
    for pattern, w in terms:
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as e:
            raise LayoutError(f"{flag}: {pattern!r} is not a valid regular expression ({e}); fix the pattern") from None
        hits = [i for i, n in enumerate(names) if regex.search(n)]
        if not hits:
            raise LayoutError(
                f"{flag}: {pattern!r} matches no layer (layers: {', '.join(dict.fromkeys(names))}); "
                f"use one of those names"
            )
        for i in hits:
            if weights[i] == 0.0:
                weights[i] = w
    return weights


def _weight(text: str, flag: str) -> float:
    try:
        w = float(text)
    except ValueError:
        raise LayoutError(f"{flag}: weight {text!r} is not a number; write NAME:WEIGHT with WEIGHT > 0") from None
    if not w > 0:
        raise LayoutError(f"{flag}: weight {text} must be > 0; give every type a positive weight")
    return w


REGISTRY: dict[str, PartitionMethod] = {
    m.name: m
    for m in (
        PartitionMethod(
            "uniform",
            "uniform",
            "equal numbers of layer specs per stage (embedding and head specs count like layers)",
            _uniform,
        ),
        PartitionMethod(
            "parameters",
            "parameters",
            "equal parameter counts per stage (the embedding and LM head weigh vocab x hidden)",
            _parameters,
            needs=(SPEC_WEIGHTS,),
        ),
        PartitionMethod(
            "memory",
            "memory",
            "minimise the largest predicted stage memory (weights, optimizer states, activations in flight)",
            _memory,
            needs=(STAGE_MEMORY,),
            layout_alias="auto",
            planned=True,
        ),
        PartitionMethod(
            "fastest",
            "fastest",
            "the smallest simulated step of the run's pipeline schedule (stage times from FLOPs) with every "
            "stage's predicted memory <= "
            "--pp-memory-limit",
            _fastest,
            needs=(STAGE_TIME, STAGE_MEMORY, STEP_TIME, MEMORY_LIMIT),
            planned=True,
        ),
        PartitionMethod(
            "profile",
            "profile",
            "as fastest, with stage times measured by timing each group (embedding, one layer, head and loss) "
            "once in this process before the layout is built",
            _profile,
            needs=(MEASURED_STAGE_TIME, STAGE_MEMORY, STEP_TIME, MEMORY_LIMIT),
        ),
        PartitionMethod(
            "type:",
            "type:REGEX or type:NAME:WEIGHT|NAME:WEIGHT",
            "equal counts (or weights) of the layers whose names match, case-insensitive",
            _types,
        ),
    )
}


def find(method: str) -> PartitionMethod:
    """The registry entry for a `--pp-partition-method` value; LayoutError naming the known ones."""
    for entry in REGISTRY.values():
        if entry.matches(method):
            return entry
    known = ", ".join(m.syntax for m in REGISTRY.values())
    raise LayoutError(f"{FLAG} {method} is not a known method; use {known}")


def from_layout_alias(layout: str) -> PartitionMethod | None:
    """The method a `--pp-layout` value stands for (`auto` -> memory), else None."""
    text = layout.strip().lower()
    return next((m for m in REGISTRY.values() if m.layout_alias == text), None)


def planned_methods() -> tuple[str, ...]:
    """Methods the planner compares, in registry order."""
    return tuple(m.name for m in REGISTRY.values() if m.planned)


def _alias_note(m: PartitionMethod) -> str:
    return f"; also --pp-layout {m.layout_alias}" if m.layout_alias else ""


def partition_method_help() -> str:
    """The `--help` text of `--pp-partition-method`."""
    items = "; ".join(f"{m.syntax} = {m.summary}{_alias_note(m)}" for m in REGISTRY.values())
    return f"how the layers are split over the stages: {items}; default {DEFAULT_METHOD}"


def markdown_table() -> str:
    """The methods table of docs/layouts.md (a test regenerates it and compares)."""
    lines = ["| method | what it does | costs the caller supplies |", "| --- | --- | --- |"]
    for m in REGISTRY.values():
        needs = ", ".join(NEED_DOCS[n] for n in m.needs) or "none"
        syntax = m.syntax.replace("|", "\\|")  # a bare | would end the table cell
        lines.append(f"| `{syntax}` | {m.summary}{_alias_note(m)} | {needs} |")
    lines.append(f"\nWith no layout option the method is `{DEFAULT_METHOD}` (DeepSpeed's stock choice).")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m megatron_ds.pipeline.methods: the docs table
    print(markdown_table())
