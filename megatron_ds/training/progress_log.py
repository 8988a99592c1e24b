"""Megatron-LM's `--log-progress`: `<--save>/progress.txt`, one tab-separated line per event, appended by rank 0,
as Megatron-LM writes it (megatron/training/utils/log_utils.py `append_to_progress_log`):

    2026-12-03 10:59:00	Job ID: 1234	# GPUs: 8	Starting job
    2026-12-03 11:09:00	Job ID: 1234	# GPUs: 8	Saved checkpoint	Iteration: 100	Job throughput: 412.3 TFLOP/s/GPU	Cumulative throughput: 405.0 TFLOP/s/GPU	Floating-point operations: 1.23e+18	Tokens (in billions): 0.41

Job throughput counts the model FLOPs since this job started over its wall time; cumulative throughput counts them
since the first job of this world size in the file (Megatron-LM's `get_start_time_from_progress_log`: a line of
another world size restarts the count). The Job ID is `SLURM_JOB_ID` (empty outside Slurm).
"""

from __future__ import annotations

import os
from datetime import datetime

FILENAME = "progress.txt"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
STARTING, SAVED = "Starting job", "Saved checkpoint"


def append(save_dir: str, world_size: int, text: str, now: datetime | None = None) -> None:
    """One line (call on rank 0 only)."""
    os.makedirs(save_dir, exist_ok=True)
    stamp = (now or datetime.now()).strftime(TIME_FORMAT)
    with open(os.path.join(save_dir, FILENAME), "a") as f:
        f.write(f"{stamp}\tJob ID: {os.environ.get('SLURM_JOB_ID', '')}\t# GPUs: {world_size}\t{text}\n")


def start_of_world_size(save_dir: str, world_size: int) -> tuple[datetime | None, float]:
    """(when the first job of this world size since the last line of another started, the FLOPs its last saved
    checkpoint had then), read from the file as Megatron-LM reads it; (None, 0.0) without such a line."""
    path = os.path.join(save_dir, FILENAME)
    start, start_flops, latest_flops = None, 0.0, 0.0
    if not os.path.isfile(path):
        return None, 0.0
    for line in open(path):
        fields = line.rstrip("\n").split("\t")
        if len(fields) < 4:
            continue  # not a line this format writes
        try:
            gpus = int(fields[2].split(": ", 1)[1])
            if fields[3] == SAVED and len(fields) > 7:
                latest_flops = float(fields[7].split(": ", 1)[1])
        except (IndexError, ValueError):
            continue
        if gpus != world_size:
            start, start_flops = None, 0.0
            continue
        if fields[3] == STARTING and start is None:
            start, start_flops = datetime.strptime(fields[0], TIME_FORMAT), latest_flops
    return start, start_flops


def saved_line(
    iteration: int, flops_so_far: float, job_flops: float, job_seconds: float, world_size: int, tokens: int,
    cumulative: tuple[datetime | None, float], now: datetime,
) -> str:  # fmt: skip
    """The `Saved checkpoint` event's text: throughputs in TFLOP/s per GPU (Megatron-LM's fields and formats)."""
    job = job_flops / (max(job_seconds, 1e-9) * 1e12 * world_size)
    start, start_flops = cumulative
    elapsed = (now - start).total_seconds() if start is not None else job_seconds
    total = (flops_so_far - start_flops) / (max(elapsed, 1e-9) * 1e12 * world_size) if start is not None else job
    return (
        f"{SAVED}\tIteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
        f"Cumulative throughput: {total:.1f} TFLOP/s/GPU\tFloating-point operations: {flops_so_far:.2e}\t"
        f"Tokens (in billions): {tokens / 10**9:.2f}"
    )
