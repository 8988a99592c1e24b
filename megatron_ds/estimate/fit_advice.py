"""What would make a run fit: the memory model asked again with each change that may lower the fullest stage's
memory (`remedies.py` holds them, each with its flags and its cost). Pure: no torch.

Two askers read the same changes:

- `fit_advice`, the one-line ending of `--pp-partition-method fastest` / `profile`'s error when no
  split of the layers fits (`run_layout.build_run_layout`): the smallest larger P, recomputation,
  ZeRO-1, optimizer offload and, at pipeline size 1 (DeepSpeed's plain engine), ZeRO-2, ZeRO-3,
  ZeRO-2 with optimizer offload and ZeRO-3 parameter offload, each with the least largest stage any split reaches (exact).
- `ranked_changes`, the planner's `memory` section (`plan/memory_advice.py` renders it): every
  change that applies to a configuration, with its saving on the fullest stage under the layout
  the changed configuration gets, cheapest first; and, when none of them fits alone,
  `fitting_combination`: the cheapest two or three of them together that fit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.memory_model import stage_memory, stage_memory_for
from megatron_ds.estimate.remedies import (
    HALVE_MICRO_BATCH,
    OFFLOAD_OPTIMIZER,
    OFFLOAD_PARAM,
    ONE_BIT,
    RECOMPUTE,
    REMEDIES,
    SEQUENCE_PARALLEL,
    ZERO_1,
    ZERO_2,
    ZERO_2_OFFLOAD,
    ZERO_3,
    Remedy,
    trains,
)
from megatron_ds.pipeline.balance import minimax_split
from megatron_ds.pipeline.layout import Layout, LayoutError
from megatron_ds.units import format_bytes

LayoutFor = Callable[[MemoryInputs, str], Layout]
"""The layout a layout method (a planner `--layout` choice) gives a configuration; raises LayoutError."""


@dataclass(frozen=True)
class Change:
    """A remedy applied to one configuration: its predicted saving on the fullest stage (bytes)."""

    name: str
    flags: str
    saving: float
    cost: str
    cost_rank: int
    peak: float = 0.0
    """The fullest stage's predicted memory per rank after the change (bytes)."""


REBALANCE_COST = "none in memory or communication; stage times become unequal"


def least_memory(inputs: MemoryInputs, num_stages: int) -> float:
    """The smallest largest-stage memory any split of the layers over `num_stages` needs (exact)."""
    n = inputs.model.num_layers
    return minimax_split(n, num_stages, lambda s, k: stage_memory_for(inputs, s, num_stages, k).total)[1]


ONE_LINE: tuple[Remedy, ...] = (
    SEQUENCE_PARALLEL,
    RECOMPUTE,
    ZERO_1,
    ZERO_2,
    ZERO_3,
    OFFLOAD_OPTIMIZER,
    ZERO_2_OFFLOAD,
    OFFLOAD_PARAM,
)
"""The changes the one-line advice tries (besides a larger P), in the order it names them."""


def fit_advice(inputs: MemoryInputs, num_stages: int, limit: float) -> str:
    """`it would fit with ...` naming the smallest larger P and each of `ONE_LINE` that fits (ZeRO 2/3 and
    parameter offload at pipeline size 1 only), each with its least largest stage per rank; or what else
    to try when none does."""
    found = []
    max_stages = inputs.model.num_layers + 2
    for p in range(num_stages + 1, max_stages + 1):  # the same data parallelism, more stages (ranks)
        need = least_memory(inputs, p)
        if need <= limit:
            found.append(f"--pipeline-model-parallel-size {p} ({format_bytes(need)} on its largest stage)")
            break
    tried = [r for r in ONE_LINE if num_stages == 1 or not r.single_stage]
    where = " per rank" if num_stages == 1 else " on its largest stage"
    for remedy in tried:
        changed = remedy.change(inputs)
        if changed is not None:
            need = least_memory(changed, num_stages)
            if need <= limit:
                found.append(f"{remedy.ask(inputs, changed)} ({format_bytes(need)}{where})")
    if found:
        return "it would fit with " + ", or ".join(found)
    pair = _fitting_pair(inputs, num_stages, limit, tried)
    alone = (
        f"no larger --pipeline-model-parallel-size (up to {max_stages}), nor {', '.join(r.name for r in tried)} alone"
    )
    if pair is not None:
        return f"{alone} makes it fit; together {pair} would"
    return f"{alone} or two of them together makes it fit; lower --micro-batch-size or raise --pp-memory-limit"


def _fitting_pair(inputs: MemoryInputs, num_stages: int, limit: float, tried: Sequence[Remedy]) -> str | None:
    """The cheapest two of `tried` together whose least largest stage fits (`fitting_combination`'s order
    without a layout: any split), as flags with that stage; None when no pair does."""
    where = " per rank" if num_stages == 1 else " on its largest stage"
    best: tuple[tuple, str] | None = None
    for combo in _pairs(tried):
        steps = _steps(combo, inputs)
        if steps is None:
            continue
        need = least_memory(steps[-1][2], num_stages)
        if need > limit:
            continue
        key = (*_cheapness(combo, [r.cost_rank for r in combo]), need)
        if best is None or key < best[0]:
            flags = " ".join(r.ask(before, after) for r, before, after in steps)
            best = (key, f"{flags} ({format_bytes(need)}{where})")
    return best[1] if best else None


def _peak(inputs: MemoryInputs, layout: Layout) -> float:
    return max(s.total for s in stage_memory(inputs, layout))


def _rebuilt_peak(inputs: MemoryInputs, method: str, layout_for: LayoutFor) -> tuple[float, Layout] | None:
    """The fullest stage under the layout `method` gives `inputs`; None when there is none."""
    try:
        layout = layout_for(inputs, method)
        return _peak(inputs, layout), layout
    except (LayoutError, ValueError, ZeroDivisionError):  # an impossible configuration saves nothing
        return None


def ranked_changes(
    inputs: MemoryInputs,
    layout: Layout,
    method: str,
    layout_for: LayoutFor,
    rebalance: Sequence[str] = (),
    rebalance_flags: Callable[[str, Layout], str] = lambda method, layout: method,
) -> list[Change]:
    """Every change that applies to the configuration `inputs` laid out as `layout` by `method`,
    cheapest first (cost rank, then the larger saving): the other layout methods in `rebalance`
    that lower the fullest stage (their flags from `rebalance_flags`), then each of `REMEDIES`."""
    base, found = _peak(inputs, layout), []
    for other in rebalance:
        rebuilt = None if other == method else _rebuilt_peak(inputs, other, layout_for)
        if rebuilt is not None and base - rebuilt[0] > 0:
            name, flags = f"rebalance stages ({other})", rebalance_flags(other, rebuilt[1])
            found.append(Change(name, flags, base - rebuilt[0], REBALANCE_COST, 0, rebuilt[0]))
    for remedy in REMEDIES:
        changed = remedy.change(inputs)
        if changed is None or (remedy.single_stage and layout.num_stages > 1) or not trains(changed):
            continue
        if remedy.same_layout:
            saving = base - _peak(changed, layout)
        else:
            rebuilt = _rebuilt_peak(changed, method, layout_for)
            saving = 0.0 if rebuilt is None else base - rebuilt[0]
        found.append(
            Change(remedy.name, remedy.ask(inputs, changed), saving, remedy.cost, remedy.cost_rank, base - saving)
        )
    return sorted(found, key=lambda c: (c.cost_rank, -c.saving))


def _steps(remedies: Sequence[Remedy], inputs: MemoryInputs) -> list[tuple[Remedy, MemoryInputs, MemoryInputs]] | None:
    """Each remedy applied to what the ones before it made, with its before and after; None where one does not apply."""
    steps, now = [], inputs
    for remedy in remedies:
        changed = remedy.change(now)
        if changed is None or changed == now:
            return None
        steps.append((remedy, now, changed))
        now = changed
    return steps


def _pairs(remedies: Sequence[Remedy]) -> list[tuple[Remedy, Remedy]]:
    """Each two of `remedies` in their order (halving the micro-batch may come twice)."""
    return [(a, b) for i, a in enumerate(remedies) for b in remedies[i:] if a is not b or a is HALVE_MICRO_BATCH]


def _cheapness(combo: Sequence[Remedy], ranks: Sequence[int]) -> tuple[int, int, int, int]:
    """How cheap changes together are (`ranks`: each part's cost rank, a rebalance's too): the largest cost
    rank, then their sum, then fewer parts, then the milder remedies (REMEDIES lists equal costs mildest first)."""
    return max(ranks), sum(ranks), len(ranks), sum(REMEDIES.index(r) for r in combo)


def fitting_combination(
    inputs: MemoryInputs,
    layout: Layout,
    method: str,
    layout_for: LayoutFor,
    limit: float,
    rebalance: str | None = None,
    rebalance_flags: Callable[[str, Layout], str] = lambda method, layout: method,
) -> Change | None:
    """The cheapest changes together whose fullest stage fits `limit`, for when no single change does: two of
    `REMEDIES` (halving the micro-batch may come twice), one or two of them with the layout method
    `rebalance`. Cheapest: `_cheapness`, then the smaller fullest stage. None when none of these fits."""
    usable = [
        r
        for r in REMEDIES
        if r is not ONE_BIT and not (r.single_stage and layout.num_stages > 1) and r.change(inputs)
        if trains(r.change(inputs))
    ]
    combos: list[tuple[Remedy, ...]] = [(r,) for r in usable] + _pairs(usable)
    methods = [method] + ([rebalance] if rebalance and rebalance != method and layout.num_stages > 1 else [])
    base = _peak(inputs, layout)
    best: tuple[tuple, Change] | None = None
    for combo in combos:
        steps = _steps(combo, inputs)
        if steps is None:
            continue
        changed = steps[-1][2]
        for m in methods:
            if len(combo) + (m != method) < 2:
                continue  # a single change alone is one of `ranked_changes`' rows
            if m == method and all(r.same_layout for r in combo):
                peak, new_layout = _peak(changed, layout), layout
            else:
                rebuilt = _rebuilt_peak(changed, m, layout_for)
                if rebuilt is None:
                    continue
                peak, new_layout = rebuilt
            if peak > limit:
                continue
            parts = [(r.name, r.ask(before, after), r.cost, r.cost_rank) for r, before, after in steps]
            if m != method:
                parts.append((f"rebalance stages ({m})", rebalance_flags(m, new_layout), REBALANCE_COST, 0))
            key = (*_cheapness(combo, [p[3] for p in parts]), peak)
            if best is None or key < best[0]:
                names, flags, costs, ranks = zip(*parts)
                best = (
                    key,
                    Change(" + ".join(names), " ".join(flags), base - peak, "; ".join(costs), max(ranks), peak),
                )
    return best[1] if best else None
