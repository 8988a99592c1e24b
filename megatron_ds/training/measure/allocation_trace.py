"""Allocation traces of one training step: the most a rank's device held at once, measured.

`CpuAllocationTrace` replays torch.profiler's memory events (every block the CPU allocator hands
out or takes back); `CudaAllocationTrace` reads the CUDA caching allocator's own counters. Both:
`start()`, then `with trace.window():` around the measured step, then `stop(at_start, at_end)`
with the tensor storages alive at the window's start and end (address -> bytes); afterwards
`held_at_start`, `peak` and `held_at_end` are in bytes. Used by `megatron_ds.training.measure.memory`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null: only around the profiler's start and stop, whose C++
    side prints a `profiler_start` / `profiler_stop` trace line on every rank."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


MEASURED_STEP = "megatron_ds.memory.measured_step"
"""Name of the profiler range around the measured step."""


class CpuAllocationTrace:
    """Peak of the running sum of CPU allocations minus frees inside `window()`.

    torch.profiler (profile_memory=True, record_shapes=True) records one event per block the CPU
    allocator hands out or takes back, and which blocks every operator reads. Two blind spots
    are handled:

    * A block allocated before the profiler started and freed while it runs is not reported
      (the allocator only knows the sizes of blocks it handed out while profiling). That is why
      the trace starts one step before the measured window: the pipe-buffer slots DeepSpeed leaves
      filled after a step (the last stage's fp32 logits, the first stage's token ids) are replaced
      in the next step, so after one traced step every block the window frees is known.
    * Only the threads the profiler runs on report frees. A tensor whose last reference a gloo
      worker thread drops (the flat gradient copy of DeepSpeed's all-reduce, a sent gradient)
      is freed unseen. A block with no free event that is not alive when the window ends (its
      address is not a live tensor's storage, or was handed out again) is taken as freed when
      the last operator that read it ended; `inferred_frees` counts them.

    What is alive at the window's start and end combines both sources: the blocks the trace saw
    allocated and not yet freed, plus the scanned storages (`live_storages`) at other addresses,
    which were allocated before the trace (a scan cannot see a tensor only C++ holds, such as
    the flat gradient copy a gloo work object still references). `unseen_frees` is what those
    older storages lost during the window: the one blind spot left, 0 when the warm-up worked.
    """

    def __init__(self) -> None:
        self.held_at_start = self.peak = self.held_at_end = 0
        self.inferred_frees = self.unseen_frees = 0
        self._prof: Any = None

    @property
    def started(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True)
        with _stderr_silenced():
            primer = torch.empty(1)
            self._prof.__enter__()
            # The CPU allocator warns (once, then every 1000th time) when a block allocated before
            # profiling is freed; that is expected here (see the class docstring), so spend the
            # first warning on a 4-byte block freed while stderr is silenced.
            del primer

    @contextmanager
    def window(self) -> Iterator[None]:
        with torch.profiler.record_function(MEASURED_STEP):
            yield

    def stop(self, at_start: dict[int, int] | None = None, at_end: dict[int, int] | None = None) -> None:
        """End the trace; given the storages (address -> bytes) alive at the window's start and
        end, compute what was held at the start, at the peak and at the end."""
        prof, self._prof = self._prof, None
        with _stderr_silenced():
            prof.__exit__(None, None, None)
        if at_start is None or at_end is None:
            return
        blocks, window, inferred = _traced_blocks(prof.profiler.kineto_results, "cpu", set(at_end))
        self.inferred_frees = inferred
        events = sorted([(b[0], b[1]) for b in blocks] + [(b[3], -b[1]) for b in blocks if b[3] is not None])
        traced_then = [{b[2] for b in blocks if b[0] < t and (b[3] is None or b[3] >= t)} for t in window]
        # Storages the scans found at addresses of no traced block alive then: allocated before the trace.
        older = [
            sum(n for ptr, n in scan.items() if ptr not in traced)
            for scan, traced in zip((at_start, at_end), traced_then)
        ]
        current, start, peak = 0, None, 0  # bytes of traced blocks alive
        for t, size in events:
            if t > window[1]:
                break
            if start is None and t >= window[0]:
                start = peak = current
            current += size
            if start is not None:
                peak = max(peak, current)
        if start is None:  # no allocation or free inside the window
            start = peak = current
        self.held_at_start = older[0] + start
        self.peak = older[0] + peak
        self.held_at_end = older[1] + current
        self.unseen_frees = older[0] - older[1]


def _input_ptrs(inputs: Any) -> Iterator[int]:
    for x in inputs:
        if isinstance(x, list):
            yield from _input_ptrs(x)
        elif getattr(x, "storage_data_ptr", None):
            yield x.storage_data_ptr


def _traced_blocks(results: Any, device_type: str, live_ptrs: set[int]) -> tuple[list[list], tuple[int, int], int]:
    """([allocated at, bytes, address, freed at or None] for every block allocated in the trace,
    the `MEASURED_STEP` window (start, end), the number of inferred frees); see CpuAllocationTrace.

    Blocks are paired by address in time order (the profiler's own allocation ids merge two
    blocks at one address when the first one's free went unseen).
    """
    from torch._C._profiler import _EventType

    ALLOC, READ = 0, 1
    events, window = [], None  # (time, kind, address, bytes or read end)
    stack = list(results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == device_type:
            events.append((node.start_time_ns, ALLOC, node.extra_fields.ptr, node.extra_fields.alloc_size))
        elif node.tag == _EventType.TorchOp:
            if node.name == MEASURED_STEP:
                window = (node.start_time_ns, node.end_time_ns)
            reads = _input_ptrs(node.extra_fields.inputs)
            events.extend((node.start_time_ns, READ, ptr, node.end_time_ns) for ptr in reads)
    assert window is not None, "the measured step's profiler range is missing"
    blocks, open_at, last_read = [], {}, {}  # open_at: address -> index of the block there not yet freed
    inferred = 0

    def close_unseen(i: int) -> None:
        nonlocal inferred
        blocks[i][3], inferred = max(blocks[i][0], last_read.get(i, 0)), inferred + 1

    for t, kind, ptr, value in sorted(events, key=lambda e: e[:2]):
        i = open_at.get(ptr)
        if kind == READ:
            if i is not None:
                last_read[i] = max(last_read.get(i, 0), value)
        elif value > 0:
            if i is not None:  # handed out again: the block there was freed unseen
                close_unseen(i)
            open_at[ptr] = len(blocks)
            blocks.append([t, value, ptr, None])
        elif i is not None:  # frees of blocks allocated before the trace are not reported
            blocks[i][3] = t
            del open_at[ptr]
    for ptr, i in open_at.items():
        if ptr not in live_ptrs:
            close_unseen(i)
    return blocks, window, inferred


class CudaAllocationTrace:
    """The CUDA caching allocator's own counters: allocated at the window's start and end, and its
    max allocated inside the window."""

    def __init__(self) -> None:
        self.held_at_start = self.peak = self.held_at_end = 0
        self.inferred_frees = self.unseen_frees = 0
        self.started = False

    def start(self) -> None:
        self.started = True

    @contextmanager
    def window(self) -> Iterator[None]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.held_at_start = torch.cuda.memory_allocated()
        yield
        torch.cuda.synchronize()
        self.peak, self.held_at_end = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()

    def stop(self, at_start: dict[int, int] | None = None, at_end: dict[int, int] | None = None) -> None:
        self.started = False
