"""Stage timers (`training/measure/stage_timers.py`) on a stand-in engine: which instructions count as
compute, steps left out, eval not counted, and the report's simulated step. The real engine is
covered by tests/e2e/test_pretrain_gpt.py (a 3-rank run)."""

from __future__ import annotations

import time

import pytest
import torch
from deepspeed.runtime.pipe import schedule as ds

from megatron_ds.estimate.step_simulator import simulate
from megatron_ds.training.measure import stage_timers
from megatron_ds.training.measure.stage_timers import StageCompute, format_report, simulate_measured


def busy(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


class FakeEngine:
    """What the timers touch: the class-level instruction map, train_batch / eval_batch, stage_id."""

    stage_id = 1
    micro_batches = 2

    def __init__(self) -> None:
        self.module = torch.nn.Linear(2, 2)

    def _forward(self, buffer_id: int) -> None:
        busy(0.01)

    def _backward(self, buffer_id: int) -> None:
        busy(0.02)

    def _recv(self, buffer_id: int) -> None:
        time.sleep(0.03)  # waiting: wall time, no CPU time

    optimizer_seconds = 0.005

    def _step(self) -> None:
        busy(self.optimizer_seconds)

    _INSTRUCTION_MAP = {
        ds.ForwardPass: _forward,
        ds.BackwardPass: _backward,
        ds.RecvActivation: _recv,
        ds.OptimizerStep: _step,
    }

    def _run(self, commands: list) -> None:
        for cmd in commands:
            self._INSTRUCTION_MAP[type(cmd)](self, **cmd.kwargs)

    def train_batch(self) -> None:
        self._run([ds.RecvActivation(0), ds.ForwardPass(0), ds.RecvActivation(1), ds.ForwardPass(1)])
        self._run([ds.BackwardPass(0), ds.BackwardPass(1), ds.OptimizerStep()])

    def eval_batch(self) -> None:
        self._run([ds.ForwardPass(0)])


def test_compute_is_cpu_time_and_waiting_is_apart() -> None:
    engine = FakeEngine()
    timers = stage_timers.install(engine)
    with timers.counting(False):
        engine.train_batch()  # left out (e.g. the profiled step)
    engine.train_batch()
    engine.train_batch()
    engine.eval_batch()  # not a training step: not counted
    got = timers.summary(rank=3)
    assert (got.rank, got.stage, got.steps, got.micro_batches, got.clock) == (3, 1, 2, 2, "CPU time")
    assert got.compute["forward"] == pytest.approx(0.02, rel=0.3)
    assert got.compute["backward"] == pytest.approx(0.04, rel=0.3)
    assert got.compute["optimizer"] == pytest.approx(0.005, rel=0.5)
    assert got.wall["recv"] >= 0.06  # two blocking receives per step, in wall time
    assert got.communication == got.wall["recv"] and got.waiting >= got.wall["recv"]
    assert got.step >= got.waiting + got.wall["forward"]
    with pytest.raises(AssertionError, match="already installed"):
        stage_timers.install(engine)
    assert "_INSTRUCTION_MAP" not in vars(FakeEngine())  # the class map is untouched


def test_each_time_is_the_median_of_the_counted_steps() -> None:
    """A step that something outside slowed (the allocator's first growth, a neighbour) is left out."""
    engine = FakeEngine()
    timers = stage_timers.install(engine)
    engine.train_batch()
    engine.optimizer_seconds = 0.1  # one slow optimizer step among three
    engine.train_batch()
    engine.optimizer_seconds = 0.005
    engine.train_batch()
    got = timers.summary(rank=0)
    assert got.steps == 3 and [round(s.compute["optimizer"], 2) for s in timers.samples][1] >= 0.09
    assert got.compute["optimizer"] == pytest.approx(0.005, rel=0.5)  # the mean would be ~0.037


def rank(stage: int, fwd: float, bwd: float, opt: float, r: int | None = None) -> StageCompute:
    return StageCompute(
        rank=stage if r is None else r,
        stage=stage,
        steps=3,
        micro_batches=4,
        clock="CPU time",
        compute={"forward": fwd, "backward": bwd, "optimizer": opt},
        wall={"forward": fwd, "backward": bwd, "optimizer": opt, "recv": 0.1},
        step=1.0,
    )


def test_simulated_step_takes_the_slowest_rank_of_each_stage() -> None:
    everyone = [rank(0, 0.4, 0.8, 0.1), rank(1, 0.4, 0.8, 0.1), rank(1, 0.8, 1.6, 0.1, r=2), rank(2, 0.2, 0.4, 0.0)]
    sim = simulate_measured(everyone)
    expected = simulate(4, [0.1, 0.2, 0.05], [0.2, 0.4, 0.1], [0.1, 0.1, 0.0]).step_time
    assert sim.step == pytest.approx(expected)
    assert sim.slowest_stage == pytest.approx(2.5) and sim.step >= sim.slowest_stage
    lines = format_report(everyone)
    assert len(lines) == 5 and lines[0].startswith("[Rank 0 | stage 0] compute per step (CPU time, ms")
    assert f"{1e3 * expected:.1f} ms" in lines[-1]


def test_report_without_timed_steps() -> None:
    lines = format_report([StageCompute(0, 0, 0, 4, "CPU time")])
    assert lines == ["stage compute: no step was timed (profiled and first steps are left out); train longer to see it"]


def test_throughput_in_the_log_line_as_megatron_prints_it() -> None:
    from megatron_ds.training import logger

    tflops, mfu = logger.throughput(8e15, 2.0, 4, peak_tflops=989.4)
    assert tflops == pytest.approx(1000.0) and mfu == pytest.approx(1000.0 / 989.4)
    assert logger.throughput(8e15, 2.0, 4, None)[1] is None
    stats = logger.StepStats(1, 10, 8, 2000.0, 1e-4, 8, 2.0, 1.0, None, 100.0, 0.0, tflops_per_gpu=412.34, mfu=0.4168)
    line = logger.format_line(stats)
    assert "| elapsed time per iteration (ms): 2000.0 | throughput per GPU (TFLOP/s/GPU): 412.3 | MFU: 41.7% |" in line
    small = logger.format_line(logger.StepStats(1, 10, 8, 2000.0, 1e-4, 8, 2.0, 1.0, None, 100.0, 0.0, 0.00123))
    assert "throughput per GPU (TFLOP/s/GPU): 0.00123 | learning rate" in small
