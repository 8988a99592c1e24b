"""Batch sizes, length of training, precision and memory savers (`TrainingConfig`); the optimizer is
`config.optimizer`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron_ds.config.checks import at_least, check, one_of, optional_at_least, positive
from megatron_ds.config.schedules import (
    CurriculumConfig,
    check_rampup,
    check_step_schedule,
    rampup_batch_size,
    step_batch_size,
)

PRECISIONS = ("fp32", "bf16", "fp16")
ZERO_STAGES = (0, 1, 2, 3)
"""DeepSpeed's ZeRO stages. Its pipeline engine runs 0 and 1 only; 2 and 3 run on its plain engine,
at pipeline size 1 (`Config` refuses them with P > 1; `engine_kind` says which engine a run uses)."""
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
"""Where ZeRO's `offload_optimizer` / `offload_param` put their tensors (DeepSpeed's `device` key)."""

BOTH_RECOMPUTATIONS = (
    "selective recomputation (--recompute-activations / --recompute-granularity selective) and full "
    "recomputation (--checkpoint-activations / --recompute-granularity full) were both asked for; keep one"
)
"""Megatron has one recomputation granularity; the planner refuses the pair with the same words."""


@dataclass(frozen=True)
class TrainingConfig:
    """Batch sizes, length of training, precision and memory savers."""

    micro_batch_size: int = 1
    """Samples per micro-batch per data-parallel rank (`--micro-batch-size`)."""
    global_batch_size: int = 1
    """Samples per optimizer step over all data-parallel ranks (`--global-batch-size`); a multiple
    of micro_batch_size x data-parallel size (checked by `Config`)."""
    train_iters: int = 0
    """Optimizer steps to train (`--train-iters`, or derived from `--train-samples`; capped by `--train-tokens`)."""
    train_samples: int | None = None
    """`--train-samples` when training is sample-based: the training split's size (Megatron asks the dataset for
    exactly these; `train_iters` runs their whole global batches); None: `train_iters` x the global batch size."""
    eval_interval: int = 1000
    """Evaluate on the validation split every this many iterations (`--eval-interval`)."""
    eval_iters: int = 100
    """Batches per evaluation (`--eval-iters`); 0 disables evaluation."""
    seed: int = 1234
    """Seed of weights, data order and dropout (`--seed`)."""
    precision: str = "fp32"
    """`fp32`, `bf16` (`--bf16`) or `fp16` (`--fp16`)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage (`--zero-stage`): 0 and 1 at any pipeline size, 2 and 3 at P = 1 (plain engine)."""
    offload_optimizer: str = "none"
    """ZeRO's `offload_optimizer.device`: `cpu` or `nvme` keep the fp32 master weights, gradient partition and
    optimizer states on the host or an NVMe drive (`--offload-optimizer`; ZeRO >= 1). See `optimizer_offload`."""
    offload_param: str = "none"
    """ZeRO-3's `offload_param.device`: `cpu` or `nvme` keep the parameter partitions off the device between
    uses (`--offload-param`; ZeRO-3 only)."""
    offload_nvme_path: str | None = None
    """The `nvme_path` of NVMe offload: a directory on a local NVMe drive (`--offload-nvme-path`)."""
    cpu_optimizer: bool = False
    """Adam runs on the host as DeepSpeed's CPU Adam (`DeepSpeedCPUAdam`, `--cpu-optimizer`, as Megatron-DeepSpeed);
    without `--offload-optimizer` it offloads the optimizer to `cpu`."""
    checkpoint_activations: bool = False
    """Recompute transformer layers in backward (`--checkpoint-activations`, or Megatron's
    `--recompute-granularity full --recompute-method uniform`)."""
    checkpoint_num_layers: int = 1
    """Transformer layers per recomputed chunk (`--checkpoint-num-layers` / `--recompute-num-layers`)."""
    selective_recompute: bool = False
    """Recompute each layer's core attention (scores, softmax, attention dropout, the product with v) in
    backward and keep the rest (Megatron's `--recompute-activations`, `--recompute-granularity selective`);
    not with `checkpoint_activations` (one granularity, as in Megatron)."""
    partition_activations: bool = False
    """DeepSpeed's partitioned checkpoints (`--partition-activations` under `--deepspeed-activation-checkpointing`):
    each tensor rank keeps 1/T of every recomputed chunk's input and all-gathers it for the recompute."""
    contiguous_checkpointing: bool = False
    """Partitioned checkpoints copied into preallocated buffers (`--contigious-checkpointing`, upstream's spelling)."""
    checkpoint_in_cpu: bool = False
    """Recomputed chunks' inputs kept in host memory until their recompute (`--checkpoint-in-cpu`)."""
    synchronize_each_layer: bool = False
    """Synchronize the device before and after every checkpointed call (`--synchronize-each-layer`)."""
    profile_backward: bool = False
    """Log each checkpointed call's forward and backward time (`--profile-backward`, DeepSpeed's timers)."""
    deepspeed_config: str | None = None
    """Optional user DeepSpeed JSON merged into the generated one (`--deepspeed_config`)."""
    exit_interval: int | None = None
    """Stop after this iteration (`--exit-interval`)."""
    exit_duration_in_mins: float | None = None
    """Save (with `--save`) and stop once training has run this long (`--exit-duration-in-mins`);
    checked after every iteration, the same on every rank."""
    kill_switch_file: str | None = None
    """Megatron-DeepSpeed's `--kill-switch-file`: once this file exists (checked before every step, the same
    answer on every rank), save (with `--save`) and exit with status 0; before the first step, exit at once."""
    skip_train: bool = False
    """Evaluate only (`--skip-train`): no training step and no save, then the final validation and test
    evaluations at the loaded iteration, kept out of TensorBoard and wandb, as both upstreams do."""
    exit_signal_handler: bool = False
    """On SIGTERM finish the step, save (`--save` is required) and exit with status 0
    (`--exit-signal-handler`); without it SIGTERM and SIGINT stop every rank at once
    (`megatron_ds.training.signals`)."""
    train_tokens: int | None = None
    """Stop once this many tokens are consumed (`--train-tokens`); already folded into train_iters."""
    loss_scale: float | None = None
    """fp16 only: a static loss scale; None means dynamic scaling (`--loss-scale`)."""
    initial_loss_scale: float | None = None
    """fp16 only: first dynamic loss scale, a power of 2; DeepSpeed's 2**16 when None (`--initial-loss-scale`)."""
    min_loss_scale: float | None = None
    """fp16 only: floor of the dynamic loss scale; 1 when None (`--min-loss-scale`)."""
    loss_scale_window: int | None = None
    """fp16 only: steps without overflow before the scale doubles; 1000 when None (`--loss-scale-window`)."""
    hysteresis: int | None = None
    """fp16 only: overflows tolerated before the scale is lowered; 2 when None (`--hysteresis`)."""
    rampup_batch_size: tuple[int, int, int] | None = None
    """Megatron-DeepSpeed's `--rampup-batch-size START INCREMENT SAMPLES`: the global batch size starts
    at START and grows by INCREMENT in equal shares of SAMPLES consumed samples up to
    global_batch_size (`config.schedules.rampup_batch_size`)."""
    step_batch_size_schedule: tuple[tuple[int, int], ...] | None = None
    """Megatron-LM's `--step-batch-size-schedule`, in samples: (threshold, batch size) pairs, the first
    at 0, the last batch size global_batch_size (thresholds given in tokens are divided by
    --seq-length, as Megatron-LM does)."""
    curriculum: CurriculumConfig | None = None
    """The legacy sequence-length curriculum of `--deepspeed_config`'s `curriculum_learning` section."""
    calculate_per_token_loss: bool = False
    """Megatron-LM's `--calculate-per-token-loss`: the loss averaged over every token of the global batch.
    Here it is the mean of micro-batch means, the same while every micro-batch counts all its tokens
    (`--eod-mask-loss` is refused with it; a step whose batch masks a padded token gets a warning)."""
    deterministic_mode: bool = False
    """Bit-identical reruns (Megatron-LM's `--deterministic-mode`): deterministic NCCL and cuBLAS settings and
    torch's deterministic kernels only (`training.determinism`)."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop the run at the first step whose loss or gradient norm is NaN or Inf, before anything is saved
    (Megatron-LM's default; `--no-check-for-nan-in-loss-and-grad` trains on). Off under fp16 with dynamic loss
    scaling, whose overflows are the scaler's signal, as Megatron-LM turns it off (`training.finite_check`)."""
    manual_gc: bool = False
    """Megatron-LM's `--manual-gc`: Python's automatic garbage collection is off during training, and
    `gc.collect()` runs every manual_gc_interval steps (0: never) and around evaluations."""
    manual_gc_interval: int = 0
    """`--manual-gc-interval`: steps between collections with --manual-gc (0: none while training)."""
    manual_gc_eval: bool = True
    """Collect before and after each evaluation with --manual-gc (off with `--no-manual-gc-eval`)."""

    def __post_init__(self) -> None:
        self._from_json_forms()
        mbs, gbs = self.micro_batch_size, self.global_batch_size
        at_least("--micro-batch-size", mbs, 1)  # first: an absent --global-batch-size is derived from it
        at_least("--global-batch-size", gbs, 1)
        at_least("--train-iters", self.train_iters, 0)
        at_least("--eval-interval", self.eval_interval, 1)
        at_least("--eval-iters", self.eval_iters, 0)
        at_least("--seed", self.seed, 1, "; give a positive seed, as Megatron-DeepSpeed and Megatron-LM require")
        one_of("precision", self.precision, PRECISIONS)
        one_of("--zero-stage", self.zero_stage, ZERO_STAGES)
        self._check_offload()
        check(not (self.selective_recompute and self.checkpoint_activations), BOTH_RECOMPUTATIONS)
        self._check_checkpoint_options()
        check(
            self.checkpoint_num_layers >= 1,
            f"layers per recomputed chunk (--checkpoint-num-layers / --recompute-num-layers) is "
            f"{self.checkpoint_num_layers}; it must be >= 1",
        )
        optional_at_least("--exit-interval", self.exit_interval, 1)
        if self.exit_duration_in_mins is not None:
            positive("--exit-duration-in-mins", self.exit_duration_in_mins)
        optional_at_least("--train-tokens", self.train_tokens, 1)
        at_least("--manual-gc-interval", self.manual_gc_interval, 0)
        self._check_loss_scale()
        self._check_batch_schedule()

    def _check_checkpoint_options(self) -> None:
        """What DeepSpeed's checkpointing options need (`training.activation_checkpointing` configures them)."""
        check(
            self.partition_activations or not self.contiguous_checkpointing,
            "--contigious-checkpointing needs --partition-activations: DeepSpeed keeps only partitioned checkpoints "
            "in contiguous buffers (deepspeed.checkpointing.configure asserts it); add --partition-activations or "
            "drop --contigious-checkpointing",
        )
        on = (("--partition-activations", self.partition_activations), ("--checkpoint-in-cpu", self.checkpoint_in_cpu))
        given = [flag for flag, value in on if value]
        if not given or self.checkpoint_activations:
            return
        check(
            not self.selective_recompute,
            f"{given[0]} with selective recomputation (--recompute-activations / --recompute-granularity "
            f"selective): it configures full recomputation's checkpoints (each recomputed chunk's input, the same "
            f"on every tensor rank); selective recomputation checkpoints each rank's own q, k and v, which "
            f"partitioning would mix across tensor ranks; use --checkpoint-activations or drop {given[0]}",
        )
        check(
            False,
            f"{given[0]} needs full recomputation (--checkpoint-activations or --recompute-granularity full): it "
            f"configures the checkpoints of recomputed chunks; add --checkpoint-activations or drop {given[0]}",
        )

    def _from_json_forms(self) -> None:
        """Sections read back from a checkpoint's JSON hold lists and dicts: the frozen forms here."""
        if self.rampup_batch_size is not None:
            object.__setattr__(self, "rampup_batch_size", tuple(self.rampup_batch_size))
        if self.step_batch_size_schedule is not None:
            object.__setattr__(
                self, "step_batch_size_schedule", tuple(tuple(pair) for pair in self.step_batch_size_schedule)
            )
        if isinstance(self.curriculum, dict):
            curriculum: dict[str, Any] = self.curriculum
            object.__setattr__(self, "curriculum", CurriculumConfig(**curriculum))

    def _check_batch_schedule(self) -> None:
        check(
            self.rampup_batch_size is None or self.step_batch_size_schedule is None,
            "--rampup-batch-size and --step-batch-size-schedule were both given; keep one",
        )
        if self.rampup_batch_size is not None:
            check(len(self.rampup_batch_size) == 3, "--rampup-batch-size takes START INCREMENT SAMPLES")
            check_rampup(self.rampup_batch_size, self.global_batch_size)
        if self.step_batch_size_schedule is not None:
            check_step_schedule(self.step_batch_size_schedule, self.global_batch_size)

    def batch_size_at(self, consumed_samples: int) -> int:
        """The global batch size of the step after `consumed_samples` samples (the schedule's, else
        global_batch_size)."""
        if self.rampup_batch_size is not None:
            return rampup_batch_size(self.rampup_batch_size, self.global_batch_size, consumed_samples)
        if self.step_batch_size_schedule is not None:
            return step_batch_size(self.step_batch_size_schedule, consumed_samples)
        return self.global_batch_size

    def batch_sizes(self) -> tuple[int, ...]:
        """Every global batch size the schedule can give (for the divisibility check)."""
        if self.rampup_batch_size is not None:
            start, increment, _ = self.rampup_batch_size
            return tuple(range(start, self.global_batch_size + 1, increment))
        if self.step_batch_size_schedule is not None:
            return tuple(b for _, b in self.step_batch_size_schedule)
        return (self.global_batch_size,)

    def sizes_settle_at(self, seq_length: int) -> tuple[int, int]:
        """(consumed samples, step) from which on the batch size and the sequence length stay constant."""
        del seq_length  # the curriculum's end does not depend on it
        samples = 0
        if self.rampup_batch_size is not None:
            samples = self.rampup_batch_size[2] + 1
        elif self.step_batch_size_schedule is not None:
            samples = self.step_batch_size_schedule[-1][0]
        return samples, 0 if self.curriculum is None else self.curriculum.settle_step()

    @property
    def varies(self) -> bool:
        """The batch size or the sequence length changes during training."""
        return self.rampup_batch_size is not None or self.step_batch_size_schedule is not None or bool(self.curriculum)

    def seq_length_at(self, step: int, seq_length: int) -> int:
        """Tokens per sample of training step `step` (1-based): the curriculum's, else seq_length."""
        return seq_length if self.curriculum is None else self.curriculum.seq_length(step)

    @property
    def optimizer_offload(self) -> str:
        """Where ZeRO keeps the optimizer: `offload_optimizer`, or `cpu` for `--cpu-optimizer` alone."""
        return "cpu" if self.cpu_optimizer and self.offload_optimizer == "none" else self.offload_optimizer

    def _check_offload(self) -> None:
        one_of("--offload-optimizer", self.offload_optimizer, OFFLOAD_DEVICES)
        one_of("--offload-param", self.offload_param, OFFLOAD_DEVICES)
        z = self.zero_stage
        what = (
            "--cpu-optimizer" if self.offload_optimizer == "none" else f"--offload-optimizer {self.offload_optimizer}"
        )
        check(
            self.optimizer_offload == "none" or z >= 1,
            f"{what} needs ZeRO (DeepSpeed offloads the optimizer in its ZeRO optimizers); add --zero-stage 1, 2 or 3",
        )
        check(
            self.offload_param == "none" or z == 3,
            f"--offload-param {self.offload_param} needs --zero-stage 3 (only ZeRO-3 partitions the parameters), got "
            f"--zero-stage {z}; use --zero-stage 3 or drop --offload-param",
        )
        check(
            self.optimizer_offload != "nvme" or z == 3,
            f"--offload-optimizer nvme needs --zero-stage 3 (ZeRO-Infinity): ZeRO {z}'s optimizer runs on the host and "
            f"DeepSpeed takes nvme as cpu there; use --offload-optimizer cpu, or --zero-stage 3",
        )
        nvme = [
            f
            for f, d in (("--offload-optimizer", self.optimizer_offload), ("--offload-param", self.offload_param))
            if d == "nvme"
        ]
        check(
            not nvme or bool(self.offload_nvme_path),
            f"{nvme[0] if nvme else ''} nvme needs --offload-nvme-path, a directory on a local NVMe drive; give one",
        )

    def _check_loss_scale(self) -> None:
        for flag, value in (
            ("--loss-scale", self.loss_scale),
            ("--initial-loss-scale", self.initial_loss_scale),
            ("--min-loss-scale", self.min_loss_scale),
            ("--loss-scale-window", self.loss_scale_window),
            ("--hysteresis", self.hysteresis),
        ):
            if value is not None:
                positive(flag, value)
        initial = self.initial_loss_scale
        if initial is not None:
            nearest = 2 ** round(math.log2(initial))
            check(
                nearest == initial,
                f"--initial-loss-scale {initial} must be a power of 2 (DeepSpeed's initial_scale_power); "
                f"e.g. {nearest:g}",
            )


def check_global_batch(gbs: int, mbs: int, dp: int) -> None:
    """The global batch is whole micro-batches on every data-parallel rank (the launch's `Config` and
    `tools/show_samples.py` check it alike)."""
    check(
        gbs % (mbs * dp) == 0,
        f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x "
        f"data-parallel size {dp}; use a multiple of {mbs * dp}",
    )
