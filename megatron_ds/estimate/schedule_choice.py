"""The fastest pipeline schedule and layout that fit: every registered schedule, searched.

`choose(inputs, num_stages, memory_limit)` gives, per schedule (and for interleaving per v), the
fastest layout whose every rank fits `memory_limit` under that schedule's memory model, and its
simulated step (the schedule's own instruction streams, stage times from the compute model's
FLOPs), fastest first. One stage per rank (1F1B, ZB-H1): the exact `fastest` search
(`pipeline/fastest.py`) with the schedule's simulator as its step and its memory model as the
limit. Interleaved: v = 2, 3, 4 over the layouts DeepSpeed's count-based split and the dedicated
embedding and head stages give over v x P flat stages (the exact search covers one stage per rank
only). Pure: no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_ds.errors import LayoutError
from megatron_ds.estimate import pipeline_schedules
from megatron_ds.estimate.layout_costs import flop_stage_time
from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.memory_model import stage_memory, stage_memory_for
from megatron_ds.estimate.step_simulator import simulate, step_estimator
from megatron_ds.model.naming import gpt_spec_groups
from megatron_ds.pipeline.fastest import fastest_split
from megatron_ds.pipeline.layout import Layout, build_layout

INTERLEAVED_CHUNKS = (2, 3, 4)
DEDICATED = ("none", "pre", "post", "both")


@dataclass(frozen=True)
class ScheduleOption:
    """One schedule's fastest layout that fits."""

    schedule: str
    virtual_stages: int
    layout: Layout
    step: float
    """Simulated step (GFLOP-time units)."""
    peak_memory: float
    """The fullest rank's predicted bytes."""

    @property
    def label(self) -> str:
        return pipeline_schedules.find(self.schedule, self.virtual_stages).display

    @property
    def flags(self) -> str:
        """The pretrain_gpt.py flags that run it."""
        sched = f"--pp-schedule {self.schedule}" if self.virtual_stages == 1 else ""
        if self.virtual_stages > 1:
            sched = f"--num-virtual-stages-per-pipeline-rank {self.virtual_stages}"
        return f"{sched} --pp-layout '{self.layout.to_string()}'".strip()


def _step(inputs: MemoryInputs, layout: Layout) -> float:
    times = [flop_stage_time(inputs, layout.num_stages)(s, k) for s, k in enumerate(layout.layers_per_stage)]
    return simulate(
        inputs.num_micro_batches,
        [t.forward for t in times],
        [t.backward for t in times],
        schedule=inputs.schedule,
        weight=[t.weight for t in times],
        virtual_stages=inputs.virtual_stages,
        tied=not inputs.model.untie_embeddings_and_output_weights,
    ).step_time


def _one_stage_per_rank(inputs: MemoryInputs, num_stages: int, limit: float) -> ScheduleOption | None:
    groups = gpt_spec_groups(inputs.model)
    try:
        split = fastest_split(
            groups.num_layers,
            num_stages,
            flop_stage_time(inputs, num_stages),
            lambda s, k: stage_memory_for(inputs, s, num_stages, k).total,
            limit,
            step_time=step_estimator(
                inputs.num_micro_batches,
                tied=not inputs.model.untie_embeddings_and_output_weights,
                schedule=inputs.schedule,
            ),
        )
    except LayoutError:
        return None
    layout = Layout(groups, split.counts, "fastest")
    return ScheduleOption(inputs.schedule, 1, layout, split.step_time, split.peak_memory)


def _interleaved(inputs: MemoryInputs, num_stages: int, limit: float) -> list[ScheduleOption]:
    groups = gpt_spec_groups(inputs.model)
    out = []
    for v in INTERLEAVED_CHUNKS:
        entry = pipeline_schedules.find(inputs.schedule, v)
        if entry.check(inputs.num_micro_batches, num_stages) is not None:
            continue
        mem = dataclasses.replace(inputs, virtual_stages=v)
        for dedicated in DEDICATED:
            try:
                layout = build_layout(groups, num_stages, dedicated=dedicated, virtual_stages=v)
            except LayoutError:
                continue
            peak = max(st.total for st in stage_memory(mem, layout))
            if peak <= limit:
                out.append(ScheduleOption(inputs.schedule, v, layout, _step(mem, layout), peak))
    return out


def choose(inputs: MemoryInputs, num_stages: int, memory_limit: float) -> list[ScheduleOption]:
    """Every schedule's fastest fitting layout (one per schedule, and per v for interleaving), fastest first."""
    options: list[ScheduleOption] = []
    for entry in pipeline_schedules.REGISTRY.values():
        chunks = INTERLEAVED_CHUNKS[0] if entry.virtual else 1
        mem = dataclasses.replace(inputs, schedule=entry.name, virtual_stages=chunks)
        if entry.virtual:
            if num_stages >= 2:
                best: dict[int, ScheduleOption] = {}
                for option in _interleaved(mem, num_stages, memory_limit):
                    if option.virtual_stages not in best or option.step < best[option.virtual_stages].step:
                        best[option.virtual_stages] = option
                options += best.values()
        elif (option := _one_stage_per_rank(mem, num_stages, memory_limit)) is not None:
            options.append(option)
    return sorted(options, key=lambda o: (o.step, o.peak_memory))
