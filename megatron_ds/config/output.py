"""What a run writes: checkpoints (`CheckpointConfig`) and logs (`LoggingConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.config.checks import at_least, check, optional_at_least, positive

PROFILER_MODES = ("pt", "pt-full")
"""Megatron-DeepSpeed's `--profile` values: torch's profiler; `pt-full` also records each op's Python stack."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and loading."""

    save: str | None = None
    """Directory checkpoints are written to (`--save`)."""
    save_interval: int | None = None
    """Save every this many iterations, and at the end (`--save-interval`)."""
    save_retain_interval: int | None = None
    """Megatron-LM's `--save-retain-interval`: after each save, the checkpoint saved before it is deleted unless
    its iteration is a multiple of this (or it is a symbolic link); None keeps every checkpoint."""
    load: str | None = None
    """Directory to resume from (`--load`)."""
    load_tag: str | None = None
    """The checkpoint of `--load` to resume from, e.g. `global_step1000` (Megatron-DeepSpeed's `--load-tag`);
    None: the one `latest` names."""
    exit_on_missing_checkpoint: bool = False
    """A `--load` that holds no checkpoint yet is an error (`--exit-on-missing-checkpoint`); without it
    the run starts from scratch with a notice, as Megatron's does (`checkpoint.first_launch`)."""
    no_load_optim: bool = False
    """Load model weights only (`--no-load-optim`)."""
    no_load_rng: bool = False
    """Do not restore RNG states (`--no-load-rng`)."""
    finetune: bool = False
    """Load weights only and reset iteration and consumed samples to 0 (`--finetune`)."""
    no_load_lr_state: bool = False
    """Resume everything but the learning-rate schedule, which starts again from step 0
    (`--no-load-lr-state`)."""
    reset_iteration: bool = False
    """Resume the whole state but count iterations and consumed samples from 0 (`--reset-iteration`)."""
    no_save_optim: bool = False
    """Save weights, iteration and RNG without the optimizer and lr schedule state (`--no-save-optim`)."""

    def __post_init__(self) -> None:
        optional_at_least("--save-interval", self.save_interval, 1)
        optional_at_least("--save-retain-interval", self.save_retain_interval, 1)
        if self.save_retain_interval is not None:
            check(
                self.save_interval is not None,
                f"--save-retain-interval {self.save_retain_interval} keeps every so many --save-interval "
                "checkpoints; add --save-interval",
            )
            check(
                self.save_retain_interval % self.save_interval == 0,
                f"--save-retain-interval {self.save_retain_interval} must be a multiple of --save-interval "
                f"{self.save_interval}; give a multiple of it",
            )


@dataclass(frozen=True)
class LoggingConfig:
    """What is printed and where."""

    log_interval: int = 100
    """Print one training line every this many iterations (`--log-interval`)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (`--tensorboard-dir`)."""
    log_memory: bool = True
    """Print each stage's measured memory once, after the first log interval (`--log-memory`)."""
    log_progress: bool = False
    """Append job starts and saved checkpoints, with job and cumulative throughput, to `<--save>/progress.txt`
    (Megatron-LM's `--log-progress`; `training.progress_log`)."""
    wandb_project: str | None = None
    """Weights & Biases project the last rank logs the TensorBoard scalars to (`--wandb-project`; None or "": no
    wandb run, as in Megatron)."""
    wandb_exp_name: str | None = None
    """The wandb run's name (`--wandb-exp-name`); None: wandb names it."""
    wandb_save_dir: str | None = None
    """Where wandb writes its local files (`--wandb-save-dir`); None: `<--save>/wandb` as in Megatron, or wandb's
    default (./wandb) without --save."""
    wandb_entity: str | None = None
    """The wandb team or user that owns the project (Megatron-LM's `--wandb-entity`); None: wandb's default."""
    tensorboard_log_interval: int = 1
    """Write the iteration's scalars (loss, learning rate, grad norm, ...) to TensorBoard and wandb every this many
    iterations (`--tensorboard-log-interval`, Megatron's default 1); the throughput and iteration time, which are
    averages over the log window, are written with the log line."""
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
    log_params_norm: bool = False
    """Print (and write to TensorBoard) the L2 norm of all parameters (`--log-params-norm`)."""
    log_num_zeros_in_grad: bool = False
    """Print (and write) the number of zero elements of the reduced gradients (`--log-num-zeros-in-grad`)."""
    profile: bool = False
    """Megatron-LM's bare `--profile`: trace training steps profile_step_start+1 .. profile_step_end with torch's
    profiler (`training.housekeeping.Profiler`)."""
    profile_pt: str | None = None
    """Megatron-DeepSpeed's `--profile pt|pt-full` (`PROFILER_MODES`): trace this process's steps `profile_steps`
    with torch's profiler into `tensorboard_dir`, `pt-full` with each op's Python stack
    (`training.housekeeping.PtProfiler`); None: off."""
    profile_steps: tuple[int, int] = (2, 3)
    """The first and last step `profile_pt` traces (`--profile_steps S,E`), counted from 1 in each process as
    Megatron-DeepSpeed counts them: a resumed run's first step is step 1 again."""
    profile_step_start: int = 10
    """Iterations done when profiling starts (`--profile-step-start`)."""
    profile_step_end: int = 12
    """Iterations done when profiling stops (`--profile-step-end`)."""
    use_pytorch_profiler: bool = False
    """The torch profiler alone, no nsys range on CUDA (`--use-pytorch-profiler`)."""
    profile_ranks: tuple[int, ...] = ()
    """Global ranks that profile, under either profiler; empty: all (`--profile-ranks`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "profile_ranks", tuple(self.profile_ranks))
        object.__setattr__(self, "profile_steps", tuple(self.profile_steps))
        for name in ("wandb_project", "wandb_exp_name", "wandb_save_dir", "wandb_entity"):
            if getattr(self, name) == "":  # Megatron's default spelling of "not given"
                object.__setattr__(self, name, None)
        at_least("--log-interval", self.log_interval, 1)
        at_least("--tensorboard-log-interval", self.tensorboard_log_interval, 1)
        at_least("--tensorboard-queue-size", self.tensorboard_queue_size, 1)
        if self.peak_tflops is not None:
            positive("--peak-tflops", self.peak_tflops)
        at_least("--profile-step-start", self.profile_step_start, 0)
        check(
            self.profile_step_end > self.profile_step_start,
            f"--profile-step-end {self.profile_step_end} must be above --profile-step-start {self.profile_step_start}",
        )
        check(all(r >= 0 for r in self.profile_ranks), f"--profile-ranks {list(self.profile_ranks)}: ranks are >= 0")
        self._check_profile_pt()

    def _check_profile_pt(self) -> None:
        start, end = self.profile_steps
        steps = f"--profile_steps {start},{end}"
        check(start >= 1, f"{steps}: a process's steps count from 1, so step {start} never comes; give S >= 1")
        check(end >= start, f"{steps}: the last step {end} comes before the first {start}; give S,E with E >= S")
        if self.profile_pt is None:
            return
        check(self.profile_pt in PROFILER_MODES, f"--profile {self.profile_pt}: give pt or pt-full")
        check(
            not self.profile,
            "profile (Megatron-LM's bare --profile) and profile_pt (Megatron-DeepSpeed's --profile pt) are one flag; "
            "set one",
        )
        check(
            self.tensorboard_dir is not None,
            f"--profile {self.profile_pt} writes its trace into --tensorboard-dir, as Megatron-DeepSpeed does; "
            "add --tensorboard-dir DIR",
        )
