"""Megatron-LM's `--log-progress` file (`training/progress_log.py`): its lines and how the cumulative count finds
where the jobs of this world size began. A run writing it: tests/e2e/test_pretrain_gpt.py."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from megatron_ds.training import progress_log

T0 = datetime(2026, 12, 3, 10, 0, 0)


def line(when: str, gpus: int, text: str) -> str:
    return f"2026-12-03 {when}\tJob ID: 7\t# GPUs: {gpus}\t{text}\n"


def saved(iteration: int, flops: float) -> str:
    return progress_log.saved_line(iteration, flops, flops, 10.0, 8, 0, (None, 0.0), T0)


def test_lines_are_megatron_lms() -> None:
    text = progress_log.saved_line(100, 4.8e16, 1.6e15, 100.0, 8, 409_600_000, (T0, 0.0), datetime(2026, 12, 3, 10, 10))
    assert text == (
        "Saved checkpoint\tIteration: 100\tJob throughput: 2.0 TFLOP/s/GPU\tCumulative throughput: 10.0 TFLOP/s/GPU\t"
        "Floating-point operations: 4.80e+16\tTokens (in billions): 0.41"
    )  # 1.6e15 / (100 s x 8 GPUs) and 4.8e16 / (600 s x 8 GPUs), in TFLOP/s


def test_the_cumulative_count_restarts_at_another_world_size(tmp_path: Path) -> None:
    (tmp_path / "progress.txt").write_text(
        line("09:00:00", 8, "Starting job")
        + line("09:30:00", 8, saved(10, 1.0e15))
        + line("09:40:00", 16, "Starting job")  # another world size: the search restarts after it
        + line("09:50:00", 16, saved(20, 3.0e15))
        + line("10:00:00", 8, "Starting job")
        + line("10:05:00", 8, saved(30, 4.0e15))
        + line("10:06:00", 8, "Starting job")
    )
    assert progress_log.start_of_world_size(str(tmp_path), 8) == (datetime(2026, 12, 3, 10, 0), 3.0e15)
    assert progress_log.start_of_world_size(str(tmp_path), 16) == (None, 0.0)  # a later line of 8 GPUs ended it
    assert progress_log.start_of_world_size(str(tmp_path / "none"), 8) == (None, 0.0)


def test_append_writes_rank_zeros_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    progress_log.append(str(tmp_path / "save"), 4, progress_log.STARTING, T0)
    assert (
        tmp_path / "save" / "progress.txt"
    ).read_text() == "2026-12-03 10:00:00\tJob ID: 42\t# GPUs: 4\tStarting job\n"
