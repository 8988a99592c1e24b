"""The stage timers' report replays the run's own schedule: ZB-H1 with its measured weight passes,
interleaving with each chunk's measured compute as its flat stage."""

from __future__ import annotations

import pytest

from megatron_ds.estimate.step_simulator import simulate
from megatron_ds.training.measure.stage_timers import StageCompute, format_report, simulate_measured


def rank(stage: int, compute: dict[str, float], schedule: str, chunks: dict[str, float] | None = None) -> StageCompute:
    return StageCompute(
        rank=stage, stage=stage, steps=3, micro_batches=4, clock="CPU time", compute=compute,
        wall=dict(compute), step=1.0, schedule=schedule, virtual_stages=2 if chunks else 1, chunk_compute=chunks or {},
    )  # fmt: skip


def test_zbh1_report_adds_the_weight_passes_to_the_backward() -> None:
    everyone = [
        rank(0, {"forward": 0.4, "backward": 0.8, "optimizer": 0.1}, "zbh1"),
        rank(1, {"forward": 0.4, "backward": 0.4, "weight": 0.4, "optimizer": 0.1}, "zbh1"),
    ]
    sim = simulate_measured(everyone)
    expected = simulate(4, [0.1, 0.1], [0.2, 0.2], [0.1, 0.1], schedule="zbh1", weight=[0.0, 0.1]).step_time
    assert sim.step == pytest.approx(expected)
    lines = format_report(everyone)
    assert "weight: 400.0" in lines[1] and lines[-1].startswith("ZB-H1 step from these compute times")


def test_interleaved_report_gives_each_chunk_its_flat_stage() -> None:
    chunks = [
        {"forward/0": 0.4, "forward/1": 0.8, "backward/0": 0.8, "backward/1": 1.6},
        {"forward/0": 0.4, "forward/1": 0.4, "backward/0": 0.8, "backward/1": 0.8},
    ]
    everyone = [
        rank(r, {"forward": c["forward/0"] + c["forward/1"], "backward": c["backward/0"] + c["backward/1"],
                 "optimizer": 0.2}, "interleaved", c)
        for r, c in enumerate(chunks)
    ]  # fmt: skip
    sim = simulate_measured(everyone)
    fwd = [0.1, 0.1, 0.2, 0.1]  # flat stage c x 2 + r, per micro-batch
    bwd = [0.2, 0.2, 0.4, 0.2]
    expected = simulate(4, fwd, bwd, [0.1] * 4, schedule="interleaved", virtual_stages=2).step_time
    assert sim.step == pytest.approx(expected)
    assert format_report(everyone)[-1].startswith("interleaved 1F1B (v=2) step from these compute times")
