"""What the training loop's steps share (`Run`), and a step's model FLOPs."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from megatron_ds.config import Config, ModelConfig
from megatron_ds.estimate.compute import model_flops_per_iteration
from megatron_ds.pipeline.layout import Layout
from megatron_ds.training import logger
from megatron_ds.training.builder import Pipeline
from megatron_ds.training.preflight import Watchdog
from megatron_ds.training.run_data import RunData
from megatron_ds.training.state import TrainState
from megatron_ds.training.step_hooks import StepHooks


@dataclass
class Run:
    """Everything the loop's steps share."""

    config: Config
    layout: Layout
    pipeline: Pipeline
    """What `build_pipeline` returned: the engine, its watchdog and its stage timers."""
    state: TrainState
    watchdog: Watchdog
    rank: int
    is_logging_rank: bool
    data: RunData
    scalars: logger.Scalars | None = None
    start_time: float = 0.0
    """When setup began (time.time()); `--exit-duration-in-mins` counts from here."""
    start_flops: float = 0.0
    """The run state's FLOPs so far when this job began training (`--log-progress`'s job throughput)."""
    peak_tflops: float | None = None
    """One device's peak for MFU (`--peak-tflops`, else `estimate.devices`), None if unknown."""
    hooks: StepHooks | None = None
    """Around each step: its batch size and sequence length, --manual-gc, --profile, log extras."""

    @property
    def engine(self) -> Any:
        return self.pipeline.engine


@functools.lru_cache(maxsize=64)
def step_flops(model: ModelConfig, seq_length: int, samples: int) -> float:
    """Model FLOPs of one step of `samples` samples of `seq_length` tokens (Megatron-LM's count)."""
    return float(model_flops_per_iteration(dataclasses.replace(model, seq_length=seq_length), samples))
