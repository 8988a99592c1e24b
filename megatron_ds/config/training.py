"""The optimizer and its schedule (`OptimizerConfig`); batch sizes, length, precision (`TrainingConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ds.config.checks import at_least, check, one_of, optional_at_least, positive, probability

OPTIMIZERS = ("adam", "sgd")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
PRECISIONS = ("fp32", "bf16", "fp16")
ZERO_STAGES = (0, 1, 2, 3)
"""DeepSpeed's ZeRO stages. Its pipeline engine runs 0 and 1 only; 2 and 3 run on its plain engine,
at pipeline size 1 (`Config` refuses them with P > 1; `engine_kind` says which engine a run uses)."""
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
"""Where ZeRO's `offload_optimizer` / `offload_param` put their tensors (DeepSpeed's `device` key)."""


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
    """Decoupled weight decay; not applied to biases and norm weights (`--weight-decay`)."""
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
        check(
            not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler were both given; keep one",
        )


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
    deepspeed_config: str | None = None
    """Optional user DeepSpeed JSON merged into the generated one (`--deepspeed_config`)."""
    exit_interval: int | None = None
    """Stop after this iteration (`--exit-interval`)."""
    exit_duration_in_mins: float | None = None
    """Save (with `--save`) and stop once training has run this long (`--exit-duration-in-mins`);
    checked after every iteration, the same on every rank."""
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

    def __post_init__(self) -> None:
        mbs, gbs = self.micro_batch_size, self.global_batch_size
        check(mbs >= 1 and gbs >= 1, f"--micro-batch-size {mbs} and --global-batch-size {gbs} must be >= 1")
        at_least("--train-iters", self.train_iters, 0)
        at_least("--eval-interval", self.eval_interval, 1)
        at_least("--eval-iters", self.eval_iters, 0)
        one_of("precision", self.precision, PRECISIONS)
        one_of("--zero-stage", self.zero_stage, ZERO_STAGES)
        self._check_offload()
        check(
            self.checkpoint_num_layers >= 1,
            f"layers per recomputed chunk (--checkpoint-num-layers / --recompute-num-layers) is "
            f"{self.checkpoint_num_layers}; it must be >= 1",
        )
        optional_at_least("--exit-interval", self.exit_interval, 1)
        if self.exit_duration_in_mins is not None:
            positive("--exit-duration-in-mins", self.exit_duration_in_mins)
        optional_at_least("--train-tokens", self.train_tokens, 1)
        self._check_loss_scale()

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
