"""What a run writes: checkpoints (`CheckpointConfig`) and logs (`LoggingConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.config.checks import at_least, optional_at_least, positive


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and loading."""

    save: str | None = None
    """Directory checkpoints are written to (`--save`)."""
    save_interval: int | None = None
    """Save every this many iterations, and at the end (`--save-interval`)."""
    load: str | None = None
    """Directory to resume from (`--load`)."""
    exit_on_missing_checkpoint: bool = False
    """A `--load` that holds no checkpoint yet is an error (`--exit-on-missing-checkpoint`); without it
    the run starts from scratch with a notice, as Megatron's does (`checkpoint.first_launch`)."""
    no_load_optim: bool = False
    """Load model weights only (`--no-load-optim`)."""
    no_load_rng: bool = False
    """Do not restore RNG states (`--no-load-rng`)."""
    finetune: bool = False
    """Load weights only and reset iteration and consumed samples to 0 (`--finetune`)."""

    def __post_init__(self) -> None:
        optional_at_least("--save-interval", self.save_interval, 1)


@dataclass(frozen=True)
class LoggingConfig:
    """What is printed and where."""

    log_interval: int = 100
    """Print one training line every this many iterations (`--log-interval`)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (`--tensorboard-dir`)."""
    log_memory: bool = True
    """Print each stage's measured memory once, after the first log interval (`--log-memory`)."""
    tensorboard_queue_size: int = 1000
    """Events the TensorBoard writer buffers before flushing (`--tensorboard-queue-size`)."""
    log_timers_to_tensorboard: bool = False
    """Write the time per iteration (ms) to TensorBoard (`--log-timers-to-tensorboard`)."""
    log_batch_size_to_tensorboard: bool = False
    """Write the global batch size to TensorBoard (`--log-batch-size-to-tensorboard`)."""
    log_learning_rate_to_tensorboard: bool = True
    """Write the learning rate; off with Megatron's `--no-log-learnig-rate-to-tensorboard`."""
    log_loss_scale_to_tensorboard: bool = True
    """Write the fp16 loss scale; off with `--no-log-loss-scale-to-tensorboard`."""
    log_validation_ppl_to_tensorboard: bool = False
    """Write validation/test perplexity next to the loss (`--log-validation-ppl-to-tensorboard`)."""
    log_optimizer_states_to_tensorboard: bool = False
    """Write L2/L1 norms of the Adam moments and weights held by the logging rank (the last
    stage, its ZeRO partition) (`--log-optimizer-states-to-tensorboard`)."""
    log_memory_to_tensorboard: bool = False
    """Write the logging rank's measured memory when the memory report is made (`--log-memory-to-tensorboard`)."""
    log_world_size_to_tensorboard: bool = False
    """Write the world size (`--log-world-size-to-tensorboard`)."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for the log line's MFU (`--peak-tflops`); None: looked up by device
    name and precision (`estimate.devices`), no MFU when unknown."""

    def __post_init__(self) -> None:
        at_least("--log-interval", self.log_interval, 1)
        at_least("--tensorboard-queue-size", self.tensorboard_queue_size, 1)
        if self.peak_tflops is not None:
            positive("--peak-tflops", self.peak_tflops)
