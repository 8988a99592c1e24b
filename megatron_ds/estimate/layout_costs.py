"""The costs a partition method balances, built from the model and the memory model. Pure: no torch.

The layout engine (`megatron_ds.pipeline`) measures nothing: a method's registry entry says what
it `needs`, and `method_costs` builds exactly that (parameter counts per spec from
`model/naming.py`, the memory model's `cost(stage, num_layers)`), for runs
(`estimate/run_layout.py`) and the planner (`plan/search.py`) alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron_ds.config import ModelConfig
from megatron_ds.estimate.memory_model import MemoryInputs, StageMemory, format_bytes, stage_memory_for
from megatron_ds.model.naming import gpt_spec_param_counts
from megatron_ds.pipeline import methods
from megatron_ds.pipeline.methods import Costs, PartitionMethod


def method_costs(
    entry: PartitionMethod | None, model: ModelConfig, num_stages: int, inputs: Callable[[], MemoryInputs]
) -> Costs:
    """The costs `entry` needs, and only those (`inputs` is called only for stage memory)."""
    if entry is None:
        return Costs()
    weights = gpt_spec_param_counts(model) if methods.SPEC_WEIGHTS in entry.needs else None
    if not entry.needs_stage_memory:
        return Costs(spec_weights=weights)
    mem = inputs()

    def stage_cost(stage: int, num_layers: int) -> float:
        return stage_memory_for(mem, stage, num_stages, num_layers).total

    return Costs(spec_weights=weights, stage_memory=stage_cost)


def format_memory_table(stages: Sequence[StageMemory], usable_bytes: float | None = None) -> str:
    """The predicted memory per stage (`StageMemory` list) as a table to print under `Layout.format()`."""
    head = (
        f"{'stage':>5} {'layers':>6} {'params':>10} {'grads':>10} {'optim':>10} {'activ.':>10} "
        f"{'in-flight':>9} {'buffers':>10} {'total':>10}"
    )
    lines = ["predicted memory per GPU (estimate, see docs/planner.md for the formulas)", head]
    for st in stages:
        lines.append(
            f"{st.stage:>5} {st.num_layers:>6} {format_bytes(st.params):>10} {format_bytes(st.grads):>10} "
            f"{format_bytes(st.optimizer):>10} {format_bytes(st.activations):>10} {st.in_flight:>9} "
            f"{format_bytes(st.pipe_buffers + st.transient):>10} {format_bytes(st.total):>10}"
        )
    peak = max(stages, key=lambda st: st.total)
    summary = f"largest: stage {peak.stage} {format_bytes(peak.total)}"
    if usable_bytes is not None:
        summary += (
            f" of {format_bytes(usable_bytes)} usable ({'fits' if peak.total <= usable_bytes else 'DOES NOT FIT'})"
        )
    lines.append(summary)
    return "\n".join(lines)
