"""Flags of Megatron's group "logging": the log line, TensorBoard and wandb, the timers, and
Megatron-DeepSpeed's profiler range (`--profile_steps`, `--profile-ranks`). Megatron-LM's own logging
flags (`--profile` among them) are in `megatron_ds.flags.megatron_lm_io`; how the profiler flags set
the logging section: `megatron_ds.flags.profiler_flags`."""

from __future__ import annotations

from megatron_ds.flags.declare import VALUE, VALUES, Flag, accepted, no_op, switch

_LOG = "logging"
_ONLY_ITERATIONS = "only whole iterations are timed"

LOGGING: tuple[Flag, ...] = (
    accepted(
        "--log-interval",
        _LOG,
        "one Megatron-style line every this many iterations",
        "logging.log_interval",
        type=int,
    ),
    accepted(
        "--tensorboard-dir",
        _LOG,
        "TensorBoard scalars, written by the last rank: each iteration's values every --tensorboard-log-interval "
        "(default 1) iterations, as upstream",
        "logging.tensorboard_dir",
    ),
    accepted(
        "--wandb-project",
        _LOG,
        "log the TensorBoard scalars (same names, same logging flags) to this Weights & Biases project from the "
        "last rank; needs the wandb package (a clear error before launch without it, where Megatron-DeepSpeed "
        "warns and logs nothing)",
        "logging.wandb_project",
    ),
    accepted(
        "--wandb-exp-name",
        _LOG,
        "the wandb run's name (wandb picks one when not given, as in Megatron-DeepSpeed; Megatron-LM requires it); "
        "ignored, with a warning, without --wandb-project",
        "logging.wandb_exp_name",
    ),
    accepted(
        "--wandb-save-dir",
        _LOG,
        "wandb's local directory (default <--save>/wandb, or wandb's ./wandb without --save); ignored, with a "
        "warning, without --wandb-project",
        "logging.wandb_save_dir",
    ),
    accepted(
        "--tensorboard-queue-size",
        _LOG,
        "events the writer buffers before flushing",
        "logging.tensorboard_queue_size",
        type=int,
    ),
    switch(
        "--log-memory",
        _LOG,
        "print each stage's measured memory once after the first log interval (default on)",
        "logging.log_memory",
        megatron=False,
    ),
    switch(
        "--no-log-memory",
        _LOG,
        "do not print the per-stage memory report",
        "logging.log_memory",
        stores=False,
        dest="log_memory",
        megatron=False,
    ),
    switch(
        "--log-timers-to-tensorboard",
        _LOG,
        "writes the time per iteration (ms); we time whole iterations only",
        "logging.log_timers_to_tensorboard",
    ),
    switch(
        "--log-batch-size-to-tensorboard",
        _LOG,
        "writes the global batch size",
        "logging.log_batch_size_to_tensorboard",
    ),
    switch(
        "--no-log-learnig-rate-to-tensorboard",
        _LOG,
        "stops writing the learning rate (Megatron's spelling)",
        "logging.log_learning_rate_to_tensorboard",
        stores=False,
        dest="log_learning_rate_to_tensorboard",
    ),
    switch(
        "--no-log-loss-scale-to-tensorboard",
        _LOG,
        "stops writing the fp16 loss scale",
        "logging.log_loss_scale_to_tensorboard",
        stores=False,
        dest="log_loss_scale_to_tensorboard",
    ),
    switch(
        "--log-validation-ppl-to-tensorboard",
        _LOG,
        "writes validation and test perplexity",
        "logging.log_validation_ppl_to_tensorboard",
    ),
    switch(
        "--log-optimizer-states-to-tensorboard",
        _LOG,
        "writes L1/L2 norms of the Adam moments and weights of the logging rank (last stage, its ZeRO partition), "
        "not all-reduced over ranks",
        "logging.log_optimizer_states_to_tensorboard",
    ),
    switch(
        "--log-memory-to-tensorboard",
        _LOG,
        "writes the logging rank's measured memory when the memory report is made (needs --log-memory, the default)",
        "logging.log_memory_to_tensorboard",
    ),
    switch(
        "--log-world-size-to-tensorboard",
        _LOG,
        "writes the world size",
        "logging.log_world_size_to_tensorboard",
    ),
    accepted(
        "--peak-tflops",
        _LOG,
        "peak TFLOP/s of one device, for the log line's MFU (default: a table of common GPUs by name and precision)",
        "logging.peak_tflops",
        type=float,
        megatron=False,
    ),
    no_op("--timing-log-level", _LOG, _ONLY_ITERATIONS, takes=VALUE),
    no_op("--timing-log-option", _LOG, _ONLY_ITERATIONS, takes=VALUE),
    accepted(
        "--profile_steps",
        _LOG,
        "S,E: the first and last step --profile pt or pt-full traces, counted from 1 in each process as "
        "Megatron-DeepSpeed counts them (a resumed run's first step is step 1 again); ignored, with a warning, "
        "without --profile pt or pt-full",
        "logging.profile_steps",
        default="2,3",
        derived=True,
    ),
    accepted(
        "--profile-ranks",
        _LOG,
        "the global ranks that profile under either --profile (all when not given); both upstreams have this flag",
        "logging.profile_ranks",
        type=int,
        nargs=VALUES,
        derived=True,
    ),
    no_op(
        "--no-barrier-with-level-1-timing",
        _LOG,
        f"drops the barrier before Megatron's level-1 timers; {_ONLY_ITERATIONS}",
    ),
    switch(
        "--log-params-norm",
        _LOG,
        "the L2 norm of all parameters (each counted once over stages and tensor ranks) in the log line and "
        "TensorBoard",
        "logging.log_params_norm",
    ),
    switch(
        "--log-num-zeros-in-grad",
        _LOG,
        "the number of zero elements in the step's reduced gradients (each counted once) in the log line and "
        "TensorBoard",
        "logging.log_num_zeros_in_grad",
    ),
    accepted(
        "--tensorboard-log-interval",
        _LOG,
        "write the iteration's own loss, learning rate, grad norm, batch size, loss scale, norms and world size (and "
        "the optimizer-state norms) to TensorBoard and wandb every this many iterations, as Megatron's training_log; "
        "the throughput and iteration time, averages over the log window, are written every --log-interval",
        "logging.tensorboard_log_interval",
        type=int,
    ),
)
