"""Measured per-stage compute of DeepSpeed's pipeline engine, separate from the time a stage waits.

`install(engine)` (called once by `build_pipeline`) times every instruction the engine executes in
`train_batch`: `PipelineEngine._exec_schedule` looks each instruction's method up in
`_INSTRUCTION_MAP`, a class attribute, so an instance attribute of the same name with wrapped
functions times them without touching DeepSpeed's code or other engines. Kinds:

    compute        ForwardPass, BackwardPass (and ZB-H1's BackwardOnlyPass), WeightPass (ZB-H1's
                   deferred weight gradients, kind `weight`), OptimizerStep (the step includes the
                   gradient-norm all-reduce that clipping needs, a wait when another stage is behind)
    communication  SendActivation, RecvActivation, SendGrad, RecvGrad (blocking point-to-point:
                   mostly waiting for the peer), ReduceTiedGrads, ReduceGrads
    other          LoadMicroBatch, and whatever `train_batch` does outside instructions

Clocks: compute is measured on the device's own clock, wall time for everything else. On CPU the
compute clock is this process's CPU time (`time.process_time`): several ranks sharing a few cores
wait for a core, and CPU time leaves that out, so stages are comparable on a shared machine
(with one intra-op thread per rank, `OMP_NUM_THREADS=1`; more threads add their CPU time). On
CUDA it is CUDA events around each compute instruction (GPU time of its kernels), resolved at the
end of every step. `estimate/calibrate.py` uses the same CPU clock for `profile`.

From the per-stage compute, `format_report` gives the step the run's pipeline schedule would take
with one device per stage (`estimate/step_simulator.simulate`): what makes layouts comparable where the
wall-clock step is noise (5 ranks on 2 cores).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from megatron_ds.config.parallel import DEFAULT_PIPELINE_SCHEDULE
from megatron_ds.estimate import pipeline_schedules
from megatron_ds.estimate.step_simulator import balanced_step_time, simulate

COMPUTE = ("forward", "backward", "weight", "optimizer")
COMMUNICATION = ("send", "recv", "reduce")
MS = 1e3


def _kinds() -> dict[type, str]:
    from deepspeed.runtime.pipe import schedule as ds

    from megatron_ds.training import pipe_schedules

    return {
        ds.ForwardPass: "forward",
        ds.BackwardPass: "backward",
        pipe_schedules.BackwardOnlyPass: "backward",
        pipe_schedules.WeightPass: "weight",
        ds.OptimizerStep: "optimizer",
        ds.SendActivation: "send",
        ds.SendGrad: "send",
        ds.RecvActivation: "recv",
        ds.RecvGrad: "recv",
        ds.ReduceTiedGrads: "reduce",
        ds.ReduceGrads: "reduce",
        ds.LoadMicroBatch: "load",
    }


@dataclass
class StageCompute:
    """One rank's times per training step, in seconds, the median of the counted steps (`clock` says
    what compute is measured in). Medians: a step that a page-fault storm, a neighbour's burst or the
    allocator's first growth slowed is left out rather than averaged in."""

    rank: int
    stage: int
    steps: int
    micro_batches: int
    """Forward passes per step (gradient accumulation steps)."""
    clock: str
    compute: dict[str, float] = field(default_factory=dict)
    """forward, backward (under ZB-H1 its input-gradient passes), weight (ZB-H1's weight passes),
    optimizer on the compute clock."""
    wall: dict[str, float] = field(default_factory=dict)
    """Every instruction kind in wall time."""
    step: float = 0.0
    """The whole `train_batch`, wall time."""
    waiting: float = 0.0
    """Wall time of the step not spent in compute instructions: waiting for other stages,
    communicating, loading data (per step, the step minus its compute instructions' wall time)."""
    communication: float = 0.0
    """Wall time in send, receive and reduce instructions (part of `waiting`)."""
    schedule: str = DEFAULT_PIPELINE_SCHEDULE
    """The pipeline schedule the engine ran (`estimate/pipeline_schedules.py`), which the report replays."""
    virtual_stages: int = 1
    """Model chunks per rank (interleaved)."""
    chunk_compute: dict[str, float] = field(default_factory=dict)
    """With virtual stages: compute per kind and chunk, keyed `forward/1` (what the report's replay
    needs per flat stage)."""

    @property
    def compute_total(self) -> float:
        return sum(self.compute.get(k, 0.0) for k in COMPUTE)

    def format(self) -> str:
        ms = {k: MS * v for k, v in self.compute.items()}
        return (
            f"[Rank {self.rank} | stage {self.stage}] compute per step ({self.clock}, ms, median of {self.steps} "
            f"step(s)) | forward: {ms.get('forward', 0):.1f} | backward: {ms.get('backward', 0):.1f} | "
            + (f"weight: {ms['weight']:.1f} | " if ms.get("weight") else "")
            + f"optimizer: {ms.get('optimizer', 0):.1f} | total: {MS * self.compute_total:.1f} | not computing (wall, "
            f"ms): {MS * self.waiting:.1f}, of which send/recv/reduce: {MS * self.communication:.1f} | step "
            f"(wall, ms): {MS * self.step:.1f}"
        )


@dataclass
class Sample:
    """One step's times, in seconds (`compute` on the compute clock, `wall` per instruction kind)."""

    compute: dict[str, float] = field(default_factory=dict)
    wall: dict[str, float] = field(default_factory=dict)
    step: float = 0.0
    chunk_compute: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def add(times: dict[str, float], kind: str, seconds: float) -> None:
        times[kind] = times.get(kind, 0.0) + seconds

    @property
    def waiting(self) -> float:
        return self.step - sum(self.wall.get(k, 0.0) for k in COMPUTE)

    @property
    def communication(self) -> float:
        return sum(self.wall.get(k, 0.0) for k in COMMUNICATION)


class StageTimers:
    """Accumulates instruction times of the steps run inside `counting(True)` (all steps by default)."""

    def __init__(self, engine: Any, schedule: str = DEFAULT_PIPELINE_SCHEDULE, virtual_stages: int = 1) -> None:
        self.engine = engine
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.device = next(engine.module.parameters()).device.type
        self.clock_name = "CUDA time" if self.device == "cuda" else "CPU time"
        self._count = True
        self._in_train = False
        self._events: list[tuple[str, Any, Any]] = []
        self.reset()

    def reset(self) -> None:
        self.samples: list[Sample] = []
        """One per counted step."""
        self._step = Sample()

    @property
    def steps(self) -> int:
        return len(self.samples)

    @contextmanager
    def counting(self, on: bool) -> Iterator[None]:
        """Count the steps run inside (or leave them out: profiled steps, the first step)."""
        previous, self._count = self._count, on
        try:
            yield
        finally:
            self._count = previous

    def _timed_instruction(self, fn: Callable, kind: str) -> Callable:
        def timed(engine: Any, **kwargs: Any) -> Any:
            if not (self._in_train and self._count):
                return fn(engine, **kwargs)
            start, cpu = time.perf_counter(), time.process_time()
            events = None
            chunk = kwargs.get("chunk")
            if kind in COMPUTE and self.device == "cuda":
                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record()
            try:
                return fn(engine, **kwargs)
            finally:
                self._step.add(self._step.wall, kind, time.perf_counter() - start)
                if events is not None:
                    events[1].record()
                    self._events.append((kind, chunk, *events))
                elif kind in COMPUTE:
                    self._add_compute(kind, chunk, time.process_time() - cpu)

        return timed

    def _timed_train_batch(self, train_batch: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            self._in_train, self._step = True, Sample()
            try:
                out = train_batch(*args, **kwargs)
            finally:
                self._in_train = False
            if self._count:
                self._resolve_events()
                self._step.step = time.perf_counter() - start
                self.samples.append(self._step)
            return out

        return timed

    def _add_compute(self, kind: str, chunk: int | None, seconds: float) -> None:
        self._step.add(self._step.compute, kind, seconds)
        if chunk is not None:
            self._step.add(self._step.chunk_compute, f"{kind}/{chunk}", seconds)

    def _resolve_events(self) -> None:
        if self._events:
            torch.cuda.synchronize()
            for kind, chunk, begin, end in self._events:
                self._add_compute(kind, chunk, begin.elapsed_time(end) / MS)
            self._events.clear()

    def summary(self, rank: int) -> StageCompute:
        """Median times per counted step on this rank, each kind on its own."""
        samples = self.samples or [Sample()]

        def median(times: list[dict[str, float]], kinds: Iterable[str]) -> dict[str, float]:
            return {k: statistics.median(t.get(k, 0.0) for t in times) for k in kinds}

        return StageCompute(
            rank=rank,
            stage=self.engine.stage_id,
            steps=self.steps,
            micro_batches=self.engine.micro_batches,
            clock=self.clock_name,
            compute=median([s.compute for s in samples], COMPUTE),
            wall=median([s.wall for s in samples], sorted({k for s in samples for k in s.wall})),
            step=statistics.median(s.step for s in samples),
            # medians of per-step values, so that communication <= waiting <= step holds as in each step
            waiting=statistics.median(s.waiting for s in samples),
            communication=statistics.median(s.communication for s in samples),
            schedule=self.schedule,
            virtual_stages=self.virtual_stages,
            chunk_compute=median(
                [s.chunk_compute for s in samples], sorted({k for s in samples for k in s.chunk_compute})
            ),
        )


def install(engine: Any, schedule: str = DEFAULT_PIPELINE_SCHEDULE, virtual_stages: int = 1) -> StageTimers:
    """Time `engine`'s instructions and train steps from now on (once per engine); `schedule` is the
    pipeline schedule it runs (`config.parallel.pipeline_schedule`) with `virtual_stages` chunks per rank."""
    assert "_INSTRUCTION_MAP" not in vars(engine), "stage timers are already installed on this engine"
    timers = StageTimers(engine, schedule, virtual_stages)
    kinds = _kinds()
    engine._INSTRUCTION_MAP = {
        cmd: timers._timed_instruction(fn, kinds.get(cmd, "other")) for cmd, fn in type(engine)._INSTRUCTION_MAP.items()
    }
    engine.train_batch = timers._timed_train_batch(engine.train_batch)
    return timers


def gather(summary: StageCompute) -> list[StageCompute]:
    """Every rank's summary, on every rank (one all_gather_object)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, asdict(summary))
    return [StageCompute(**d) for d in out]


@dataclass(frozen=True)
class SimulatedStep:
    """The schedule's step from measured per-stage compute, one device per stage (seconds)."""

    step: float
    ideal: float
    """The same compute in equal stages, through the same schedule."""
    slowest_stage: float
    """The largest per-stage compute of one step."""
    measured_step: float
    """The slowest rank's wall-clock step on this machine."""


def _flat_times(s: StageCompute, kind: str, chunk: int) -> float:
    """One chunk's time of `kind` per step (the rank's whole time without virtual stages)."""
    if s.virtual_stages == 1:
        return s.compute.get(kind, 0.0)
    return s.chunk_compute.get(f"{kind}/{chunk}", 0.0)


def simulate_measured(everyone: list[StageCompute]) -> SimulatedStep:
    """Per flat stage the slowest of its ranks (data and tensor parallel copies), through the simulator."""
    num_ranks = 1 + max(s.stage for s in everyone)
    by_rank = [[s for s in everyone if s.stage == st] for st in range(num_ranks)]
    m, schedule, v = everyone[0].micro_batches, everyone[0].schedule, everyone[0].virtual_stages
    flat = [(c, ranks) for c in range(v) for ranks in by_rank]  # flat stage c x P + r

    def per_flat(kind: str, divide: int = m) -> list[float]:
        return [max(_flat_times(s, kind, c) for s in ranks) / divide for c, ranks in flat]

    fwd, wgt = per_flat("forward"), per_flat("weight")
    # the simulator's backward is the whole backward, of which `weight` the weight passes
    bwd = [b + w for b, w in zip(per_flat("backward"), wgt)]
    opt = [max(s.compute["optimizer"] for s in ranks) / v for _, ranks in flat]  # a rank's step, spread over its chunks
    step = simulate(m, fwd, bwd, opt, schedule=schedule, weight=wgt, virtual_stages=v).step_time
    ideal = balanced_step_time(m, fwd, bwd, schedule, weight=wgt, virtual_stages=v) + v * sum(opt) / num_ranks
    slowest = max(
        sum(m * (fwd[c * num_ranks + r] + bwd[c * num_ranks + r]) + opt[c * num_ranks + r] for c in range(v))
        for r in range(num_ranks)
    )
    return SimulatedStep(step, ideal, slowest, max(s.step for s in everyone))


def format_report(everyone: list[StageCompute]) -> list[str]:
    """One line per rank, then the simulated step (empty when no step was counted)."""
    if not everyone or min(s.steps for s in everyone) == 0:
        return ["stage compute: no step was timed (profiled and first steps are left out); train longer to see it"]
    lines = [s.format() for s in sorted(everyone, key=lambda s: s.rank)]
    sim = simulate_measured(everyone)
    lines.append(
        f"{pipeline_schedules.find(everyone[0].schedule, everyone[0].virtual_stages).display} step from these compute times with one device per stage (schedule simulator): {MS * sim.step:.1f} ms "
        f"= {sim.step / sim.ideal:.3f} x the ideal {MS * sim.ideal:.1f} ms (the same compute in equal stages); "
        f"slowest stage computes {MS * sim.slowest_stage:.1f} ms; measured wall-clock step here "
        f"{MS * sim.measured_step:.1f} ms"
    )
    return lines
