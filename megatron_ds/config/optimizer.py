"""The optimizer and its learning-rate and weight-decay schedules (`OptimizerConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.config.checks import at_least, check, one_of, optional_at_least, probability

OPTIMIZERS = ("adam", "sgd")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
WD_INCR_STYLES = ("constant", "linear", "cosine")


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
