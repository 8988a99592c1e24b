"""One planned configuration (`Candidate`): its degrees, micro-batch, ZeRO stage, recomputation, layout and
schedule, its predicted memory per stage and step in seconds, and what the report reads of them (the peak stage,
the recomputation label, the bubble). The search (`plan/search.py`) builds them; the sections read them."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.estimate import pipeline_schedules
from megatron_ds.estimate.memory_inputs import MemoryInputs, StageMemory
from megatron_ds.estimate.step_inputs import StepTime
from megatron_ds.estimate.step_simulator import bubble_ratio, idle_fraction
from megatron_ds.pipeline.costs import StageTime
from megatron_ds.pipeline.layout import Layout


@dataclass(frozen=True)
class Candidate:
    """One complete parallel configuration and its predicted memory."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    num_micro_batches: int
    zero_stage: int
    precision: str
    checkpoint_activations: bool
    method: str
    layout: Layout
    stages: tuple[StageMemory, ...]
    inputs: MemoryInputs
    times: tuple[StageTime, ...] = ()
    """Per stage: one micro-batch's forward and backward (recomputation included) in GFLOP."""
    time: StepTime | None = None
    """The predicted step in seconds (`plan/timing.py`)."""

    @property
    def seconds(self) -> float:
        assert self.time is not None
        return self.time.seconds

    @property
    def step(self) -> float:
        """The predicted step, seconds."""
        return self.seconds

    @property
    def ideal(self) -> float:
        """The same compute in equal stages with no bubble and no communication between stages, seconds."""
        assert self.time is not None
        return self.time.ideal

    @property
    def peak(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def selective_recompute(self) -> bool:
        return self.inputs.selective_recompute

    @property
    def sequence_parallel(self) -> bool:
        return self.inputs.sequence_parallel

    @property
    def recompute(self) -> str:
        """`none`, `selective` (the core attention) or `full` (whole layers)."""
        return "full" if self.checkpoint_activations else "selective" if self.selective_recompute else "none"

    @property
    def recompute_label(self) -> str:
        """`off`, `selective` or `full`, with where full recomputation's checkpoints wait (`--partition-activations`,
        `--checkpoint-in-cpu`)."""
        where = [
            text
            for text, on in (
                (f"partitioned over t={self.tp}", self.inputs.partition_activations),
                ("in host memory", self.inputs.checkpoint_in_cpu),
            )
            if on
        ]
        label = "off" if self.recompute == "none" else self.recompute
        return label + (f" (checkpoints {', '.join(where)})" if where else "")

    @property
    def offload_optimizer(self) -> str:
        return self.inputs.offload_optimizer

    @property
    def offload_param(self) -> str:
        return self.inputs.offload_param

    @property
    def engine(self) -> str:
        """DeepSpeed's `pipeline` engine (ZeRO 0/1, any P) or its `plain` one (ZeRO 2/3, mixture of experts; P = 1)."""
        return self.inputs.engine

    @property
    def expert_parallel_size(self) -> int:
        """E: the ranks that share out each MoE layer's experts (1 for a dense model)."""
        return self.inputs.expert_parallel_size

    @property
    def host_per_gpu(self) -> float:
        """Offloaded model states of the fullest stage's GPU, held in host memory."""
        return max(s.host for s in self.stages)

    @property
    def schedule(self) -> pipeline_schedules.PipelineSchedule:
        return pipeline_schedules.find(self.inputs.schedule, self.inputs.virtual_stages)

    @property
    def virtual_stages(self) -> int:
        return self.inputs.virtual_stages

    @property
    def rank_times(self) -> tuple[StageTime, ...]:
        """Per rank: `times` summed over its chunks (flat stage c x P + r)."""
        p, v = self.pp, self.virtual_stages
        chunks = [[self.times[c * p + r] for c in range(v)] for r in range(p)]
        return tuple(StageTime(sum(t.forward for t in ts), sum(t.backward for t in ts)) for ts in chunks)

    @property
    def bubble(self) -> float:
        """Bubble time over ideal time with equal stages and unit passes (1F1B: (p - 1) / m, Narayanan
        et al. 2021 eq. 1; `step_simulator.bubble_ratio`)."""
        return bubble_ratio(self.inputs.schedule, self.num_micro_batches, self.pp, self.virtual_stages)

    @property
    def idle_fraction(self) -> float:
        """Share of the step a stage idles with equal stages (1F1B: (p - 1) / (m + p - 1))."""
        return idle_fraction(self.inputs.schedule, self.num_micro_batches, self.pp, self.virtual_stages)
