"""Per-step housekeeping that leaves the numbers alone: Megatron-LM's `--manual-gc` (Python's garbage
collection at chosen steps only), and a torch profiler trace of a step range: Megatron-LM's bare `--profile`
(`Profiler`) or Megatron-DeepSpeed's `--profile pt|pt-full` (`PtProfiler`)."""

from __future__ import annotations

import gc
import os
import socket
import time
import warnings
from typing import Any

import torch

from megatron_ds.config import Config


class ManualGC:
    """`--manual-gc`: automatic collection off from the first step; `gc.collect()` every
    `--manual-gc-interval` steps and, unless `--no-manual-gc-eval`, before and after evaluations
    (Megatron-LM's `train` and `evaluate_and_print_results`)."""

    def __init__(self, config: Config) -> None:
        t = config.training
        self.on, self.interval, self.around_eval = t.manual_gc, t.manual_gc_interval, t.manual_gc_eval
        if self.on:
            gc.disable()
            gc.collect()

    def after_step(self, iteration: int) -> None:
        if self.on and self.interval and iteration % self.interval == 0:
            gc.collect()

    def around_evaluation(self) -> None:
        if self.on and self.around_eval:
            gc.collect()

    def close(self) -> None:
        if self.on:
            gc.enable()


def _activities() -> list[torch.profiler.ProfilerActivity]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def profile_dir(config: Config) -> str:
    """Megatron-LM's `<--tensorboard-dir>/../torch_profile` (./torch_profile without a TensorBoard dir)."""
    base = config.logging.tensorboard_dir
    return os.path.join(base, "..", "torch_profile") if base else "torch_profile"


class Profiler:
    """`--profile`: torch's profiler over the steps that start with `--profile-step-start` iterations
    done and end with `--profile-step-end` done, on `--profile-ranks` (all when empty); the trace is
    written as `rank-<r>.json.gz` into `profile_dir`. On CUDA without `--use-pytorch-profiler` the range
    is also marked for nsys (`cudaProfilerStart/Stop`), as Megatron-LM does."""

    def __init__(self, config: Config, rank: int) -> None:
        lg = config.logging
        self.on = lg.profile and (not lg.profile_ranks or rank in lg.profile_ranks)
        self.start, self.end, self.rank = lg.profile_step_start, lg.profile_step_end, rank
        self.nsys = self.on and not lg.use_pytorch_profiler and torch.cuda.is_available()
        self.directory = profile_dir(config)
        self._prof: Any = None

    def before_step(self, iteration: int) -> None:
        """`iteration`: the steps done before this one."""
        if not self.on or iteration != self.start:
            return
        self._prof = torch.profiler.profile(activities=_activities())
        self._prof.__enter__()
        if self.nsys:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())

    def after_step(self, iteration: int) -> str | None:
        """Stops and writes the trace once `iteration` steps are done; returns its path then."""
        if self._prof is None or iteration != self.end:
            return None
        if self.nsys:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
        self._prof.__exit__(None, None, None)
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"rank-{self.rank}.json.gz")
        self._prof.export_chrome_trace(path)
        self._prof = None
        return path

    def close(self) -> None:
        """Training ended inside the range: stop without writing."""
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None


def trace_name() -> str:
    """The name torch's `tensorboard_trace_handler(dir, use_gzip=True)` gives a trace (its default worker name)."""
    return f"{socket.gethostname()}_{os.getpid()}.{time.time_ns()}.pt.trace.json.gz"


class PtProfiler:
    """`--profile pt|pt-full` (Megatron-DeepSpeed's megatron/profiler.py): torch's profiler from the beginning of
    step S to the end of step E of this process (`--profile_steps S,E`; steps count from 1 in each process, not
    the run's iterations), on `--profile-ranks` (all when empty), under upstream's schedule (one active window
    of E-S+1 steps); `pt-full` records each op's Python stack (`with_stack`). The trace is written into
    `--tensorboard-dir` under the name torch's `tensorboard_trace_handler` gives it (`trace_name`)."""

    def __init__(self, config: Config, rank: int) -> None:
        lg = config.logging
        self.on = lg.profile_pt is not None and (not lg.profile_ranks or rank in lg.profile_ranks)
        self.start, self.end = lg.profile_steps
        self.with_stack = lg.profile_pt == "pt-full"
        self.directory = lg.tensorboard_dir or ""
        self.step = 0
        """This process's steps begun."""
        self._prof: Any = None
        self._written: str | None = None

    def before_step(self, iteration: int) -> None:
        """`iteration` (the run's steps done) is not upstream's count: this process's steps are."""
        self.step += 1
        if not self.on or self.step != self.start:
            return
        with warnings.catch_warnings():
            # upstream's schedule has no warm-up on purpose: step S is traced, not a step before it
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            schedule = torch.profiler.schedule(wait=0, warmup=0, active=self.end - self.start + 1, repeat=1)
        self._prof = torch.profiler.profile(
            schedule=schedule, activities=_activities(), on_trace_ready=self._write, with_stack=self.with_stack
        )
        self._prof.start()

    def after_step(self, iteration: int) -> str | None:
        """Ends a traced step; at the end of step E the schedule's window closes and the trace is written:
        returns its path then."""
        if self._prof is None:
            return None
        self._prof.step()  # the step() that ends the window calls _write
        if self.step != self.end:
            return None
        self._prof.stop()
        self._prof = None
        path, self._written = self._written, None
        return path

    def _write(self, prof: torch.profiler.profile) -> None:
        os.makedirs(self.directory, exist_ok=True)
        self._written = os.path.join(self.directory, trace_name())
        prof.export_chrome_trace(self._written)

    def close(self) -> None:
        """Training ended inside the range: stop without writing."""
        if self._prof is not None:
            self._prof.on_trace_ready = None  # stop() inside the window would write the partial trace
            self._prof.stop()
            self._prof = None


def build_profiler(config: Config, rank: int) -> Profiler | PtProfiler:
    """The profiler `--profile` asks for: Megatron-DeepSpeed's with a value (pt, pt-full), else Megatron-LM's
    (which does nothing without the bare flag)."""
    return PtProfiler(config, rank) if config.logging.profile_pt is not None else Profiler(config, rank)
