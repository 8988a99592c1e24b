"""The optimizer and its schedule (`OptimizerConfig`); batch sizes, length, precision (`TrainingConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron_ds.config.checks import at_least, check, one_of, optional_at_least, positive, probability
from megatron_ds.config.schedules import (
    CurriculumConfig,
    check_rampup,
    check_step_schedule,
    rampup_batch_size,
    step_batch_size,
)

OPTIMIZERS = ("adam", "sgd")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
WD_INCR_STYLES = ("constant", "linear", "cosine")
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
class OptimizerConfig:
    """Optimizer and learning-rate schedule."""

    optimizer: str = "adam"
    """`adam` (AdamW with decoupled weight decay, as Megatron) or `sgd` (`--optimizer`)."""
    lr: float = 1e-4
    """Peak learning rate (`--lr`)."""
    min_lr: float = 0.0
    """Floor of the decay; <= lr (`--min-lr`)."""
    weight_decay: float = 0.01
    """Decoupled weight decay; not applied to biases and norm weights (`--weight-decay`). With a
    `linear` or `cosine` weight_decay_incr_style the schedule's start and end replace it."""
    weight_decay_incr_style: str = "constant"
    """`constant`, or `linear` / `cosine` from start_weight_decay to end_weight_decay over the
    training samples, as Megatron's OptimizerParamScheduler (`--weight-decay-incr-style`)."""
    start_weight_decay: float | None = None
    """First weight decay of a linear or cosine schedule (`--start-weight-decay`)."""
    end_weight_decay: float | None = None
    """Last weight decay of a linear or cosine schedule, >= start (`--end-weight-decay`)."""
    weight_decay_incr_samples: int = 0
    """Samples over which a linear or cosine weight decay goes from start to end: --train-samples, else
    --train-iters x --global-batch-size (Megatron's wd_incr_steps; set with the style)."""
    create_moe_param_group: bool = False
    """Megatron-DeepSpeed's `--create-moe-param-group`: the experts' parameters move into optimizer groups of their
    own (DeepSpeed's `split_params_into_different_moe_groups_for_optimizer`, one per weight-decay group), which
    DeepSpeed's ZeRO needs; the update is the same either way."""
    decoupled_lr: float | None = None
    """Megatron-LM's `--decoupled-lr`: the peak learning rate of the word embedding and output layer
    weights (their own optimizer group, same schedule shape); None: `lr` for every parameter."""
    decoupled_min_lr: float | None = None
    """`--decoupled-min-lr`: the floor of that group's decay; None: min_lr."""
    adam_beta1: float = 0.9
    """Adam beta1, in [0, 1) (`--adam-beta1`)."""
    adam_beta2: float = 0.999
    """Adam beta2, in [0, 1) (`--adam-beta2`)."""
    adam_eps: float = 1e-8
    """Adam epsilon (`--adam-eps`)."""
    sgd_momentum: float = 0.9
    """SGD momentum (`--sgd-momentum`)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (`--clip-grad`)."""
    lr_decay_style: str = "linear"
    """`constant`, `linear`, `cosine` or `inverse-square-root` (`--lr-decay-style`)."""
    lr_decay_iters: int | None = None
    """Iterations over which lr decays to min_lr; train iterations by default (`--lr-decay-iters`)."""
    lr_warmup_iters: int = 0
    """Linear warm-up iterations (`--lr-warmup-iters`); see also `--lr-warmup-fraction`."""
    lr_warmup_samples: int = 0
    """Linear warm-up over this many samples (`--lr-warmup-samples`; sample-based training)."""
    lr_decay_samples: int | None = None
    """Samples over which lr decays (`--lr-decay-samples`); --train-samples by default."""
    lr_warmup_tokens: int | None = None
    """Linear warm-up over this many tokens (`--lr-warmup-tokens`); tokens = samples x seq_length."""
    lr_warmup_fraction: float | None = None
    """Linear warm-up over this fraction of the decay, in [0, 1] (`--lr-warmup-fraction`): Megatron's
    `lr_warmup_fraction * lr_decay_steps`, kept fractional, not rounded to whole steps."""
    lr_decay_tokens: int | None = None
    """Tokens over which lr decays (`--lr-decay-tokens`); takes precedence over iterations/samples."""
    override_opt_param_scheduler: bool = False
    """On resume use the flags' schedule, not the checkpoint's (`--override-opt_param-scheduler`)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume use the checkpoint's schedule, not the flags' (`--use-checkpoint-opt_param-scheduler`).
    With neither flag a difference between the two is an error."""

    def __post_init__(self) -> None:
        one_of("--optimizer", self.optimizer, OPTIMIZERS)
        at_least("--min-lr", self.min_lr, 0)
        at_least("--lr", self.lr, 0)
        check(self.min_lr <= self.lr, f"--min-lr {self.min_lr} is above --lr {self.lr}; lower --min-lr")
        at_least("--weight-decay", self.weight_decay, 0)
        probability("--adam-beta1", self.adam_beta1)
        probability("--adam-beta2", self.adam_beta2)
        at_least("--adam-eps", self.adam_eps, 0)
        at_least("--sgd-momentum", self.sgd_momentum, 0)
        at_least("--clip-grad", self.clip_grad, 0, " (0 disables clipping)")
        one_of("--lr-decay-style", self.lr_decay_style, LR_DECAY_STYLES)
        for flag, value in (
            ("--lr-decay-iters", self.lr_decay_iters),
            ("--lr-decay-samples", self.lr_decay_samples),
            ("--lr-decay-tokens", self.lr_decay_tokens),
            ("--lr-warmup-iters", self.lr_warmup_iters),
            ("--lr-warmup-samples", self.lr_warmup_samples),
            ("--lr-warmup-tokens", self.lr_warmup_tokens),
        ):
            optional_at_least(flag, value, 0)
        fraction = self.lr_warmup_fraction
        check(fraction is None or 0.0 <= fraction <= 1.0, f"--lr-warmup-fraction {fraction} must be in [0, 1]")
        check(
            not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler were both given; keep one",
        )
        self._check_weight_decay_schedule()
        self._check_decoupled_lr()

    def schedule_lengths(self, train_iters: int, global_batch_size: int, seq_length: int) -> tuple[str, float, int]:
        """(unit, warm-up, decay): the schedule's lengths in its one unit of progress, `tokens` (samples x
        seq_length) when a token bound is given, else `samples` (an iteration is the global batch size)."""
        in_tokens = self.lr_warmup_tokens is not None or self.lr_decay_tokens is not None
        per_sample = seq_length if in_tokens else 1  # one sample in the schedule's unit
        if self.lr_decay_tokens is not None:
            decay = self.lr_decay_tokens
        elif self.lr_decay_samples is not None:
            decay = self.lr_decay_samples * per_sample
        else:
            decay = (self.lr_decay_iters or train_iters) * global_batch_size * per_sample
        warmup: float
        if self.lr_warmup_fraction is not None:
            warmup = self.lr_warmup_fraction * decay
        elif self.lr_warmup_tokens is not None:
            warmup = self.lr_warmup_tokens
        elif self.lr_warmup_samples:
            warmup = self.lr_warmup_samples * per_sample
        else:
            warmup = self.lr_warmup_iters * global_batch_size * per_sample
        return ("tokens" if in_tokens else "samples"), warmup, decay

    def check_schedule(self, train_iters: int, global_batch_size: int, seq_length: int) -> None:
        """Megatron's OptimizerParamScheduler asserts a decay longer than the warm-up (a config that trains nothing,
        `train_iters` 0, is not held to it)."""
        unit, warmup, decay = self.schedule_lengths(train_iters, global_batch_size, seq_length)
        if warmup == 0 or train_iters == 0:
            return
        given = [
            f"{flag} {value:g}"
            for flag, value in (
                ("--lr-warmup-fraction", self.lr_warmup_fraction),
                ("--lr-warmup-tokens", self.lr_warmup_tokens),
                ("--lr-warmup-samples", self.lr_warmup_samples or None),
                ("--lr-warmup-iters", self.lr_warmup_iters or None),
            )
            if value is not None
        ][:1]
        check(
            warmup < decay,
            f"{given[0] if given else 'the warm-up'} warms up over {warmup:g} {unit}, not less than the decay's "
            f"{decay:g} (--lr-decay-*, by default the training length); Megatron requires a warm-up shorter than "
            f"the decay: shorten the warm-up or lengthen the decay",
        )

    def _check_weight_decay_schedule(self) -> None:
        """Megatron's rule: `constant` takes --weight-decay alone; linear/cosine take both ends."""
        style, start, end = self.weight_decay_incr_style, self.start_weight_decay, self.end_weight_decay
        one_of("--weight-decay-incr-style", style, WD_INCR_STYLES)
        if style == "constant":
            given = [f for f, v in (("--start-weight-decay", start), ("--end-weight-decay", end)) if v is not None]
            check(
                not given,
                f"{' and '.join(given)} need --weight-decay-incr-style linear or cosine (constant uses "
                f"--weight-decay); add the style or drop them",
            )
            return
        check(
            start is not None and end is not None,
            f"--weight-decay-incr-style {style} needs --start-weight-decay and --end-weight-decay; give both",
        )
        at_least("--start-weight-decay", start, 0)
        at_least("--end-weight-decay", end, 0)
        check(end >= start, f"--end-weight-decay {end} is below --start-weight-decay {start}; Megatron increases it")
        at_least("weight-decay schedule length (samples)", self.weight_decay_incr_samples, 1)

    def _check_decoupled_lr(self) -> None:
        if self.decoupled_lr is None:
            check(self.decoupled_min_lr is None, "--decoupled-min-lr needs --decoupled-lr; add it or drop it")
            return
        at_least("--decoupled-lr", self.decoupled_lr, 0)
        floor = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        at_least("--decoupled-min-lr", floor, 0)
        check(
            floor <= self.decoupled_lr,
            f"--decoupled-min-lr {floor} is above --decoupled-lr {self.decoupled_lr}; lower it",
        )

    def weight_decay_range(self) -> tuple[float, float]:
        """(start, end) of the weight decay; both --weight-decay when constant."""
        if self.weight_decay_incr_style == "constant":
            return self.weight_decay, self.weight_decay
        assert self.start_weight_decay is not None and self.end_weight_decay is not None
        return self.start_weight_decay, self.end_weight_decay


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
