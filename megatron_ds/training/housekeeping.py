"""Megatron-LM's per-step housekeeping that leaves the numbers alone: `--manual-gc` (Python's
garbage collection at chosen steps only) and `--profile` (a torch profiler trace of a step range)."""

from __future__ import annotations

import gc
import os
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
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities)
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
