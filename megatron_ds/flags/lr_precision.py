"""Flags of Megatron's groups "learning rate" (the peak, the floor, the decay style, warm-up and decay
lengths in iterations, samples or tokens, which schedule wins on resume) and "mixed precision" (fp16
and bf16, fp16's loss scaling, and the fp32 options that change nothing here)."""

from __future__ import annotations

from megatron_ds.config import LR_DECAY_STYLES
from megatron_ds.flags.declare import VALUE, Flag, accepted, no_op, refused, switch

_LR, _MIXED = "learning rate", "mixed precision"

_SCHEDULE = ("optimizer.lr_decay_iters", "optimizer.lr_decay_samples", "optimizer.lr_decay_tokens")
_WARMUP = ("optimizer.lr_warmup_iters", "optimizer.lr_warmup_samples", "optimizer.lr_warmup_tokens")


def _schedule(name: str, help: str, fields: tuple[str, ...], default: int | None = None) -> Flag:
    """A warm-up or decay length: `lengths.py` puts it into the one unit the schedule uses."""
    return accepted(name, _LR, help, type=int, default=default, fields=fields, derived=True)


LEARNING_RATE: tuple[Flag, ...] = (
    accepted("--lr", _LR, "peak learning rate", "optimizer.lr", type=float, default=None, derived=True),
    accepted("--min-lr", _LR, "floor of the decay", "optimizer.min_lr", type=float),
    accepted(
        "--lr-decay-style",
        _LR,
        "`constant`, `linear`, `cosine` or `inverse-square-root`",
        "optimizer.lr_decay_style",
        choices=LR_DECAY_STYLES,
    ),
    _schedule("--lr-decay-iters", "decay length in iterations (iteration-based training)", _SCHEDULE),
    _schedule("--lr-decay-samples", "decay length in samples (sample-based training)", _SCHEDULE),
    _schedule("--lr-decay-tokens", "decay length in tokens (samples x seq length); wins over the others", _SCHEDULE),
    _schedule("--lr-warmup-iters", "linear warm-up in iterations", _WARMUP, default=0),
    _schedule("--lr-warmup-samples", "linear warm-up in samples", _WARMUP, default=0),
    _schedule("--lr-warmup-tokens", "linear warm-up in tokens", _WARMUP),
    accepted(
        "--lr-warmup-fraction",
        _LR,
        "warm-up as a fraction of the decay length",
        type=float,
        fields=(*_WARMUP, "optimizer.lr_warmup_fraction"),
        derived=True,
    ),
    switch(
        "--override-opt_param-scheduler",
        _LR,
        "on resume, use the flags' schedule, not the checkpoint's (without either flag a difference is an error); "
        "also spelled --override-opt-param-scheduler (Megatron-LM's) and --override-lr-scheduler (the older name)",
        "optimizer.override_opt_param_scheduler",
        aliases=("--override-opt-param-scheduler", "--override-lr-scheduler"),
    ),
    switch(
        "--use-checkpoint-opt_param-scheduler",
        _LR,
        "on resume, keep the checkpoint's schedule; also spelled --use-checkpoint-opt-param-scheduler (Megatron-LM's) "
        "and --use-checkpoint-lr-scheduler (the older name)",
        "optimizer.use_checkpoint_opt_param_scheduler",
        aliases=("--use-checkpoint-opt-param-scheduler", "--use-checkpoint-lr-scheduler"),
    ),
    refused("--warmup", _LR, "Megatron's deprecated name", "use --lr-warmup-fraction", VALUE),
)

MIXED_PRECISION: tuple[Flag, ...] = (
    switch(
        "--fp16",
        _MIXED,
        "DeepSpeed fp16 with dynamic loss scaling (needs a GPU)",
        "training.precision",
        derived=True,
        exclusive="precision",
    ),
    switch("--bf16", _MIXED, "DeepSpeed bf16", "training.precision", derived=True, exclusive="precision"),
    accepted(
        "--loss-scale",
        _MIXED,
        "fp16: a static loss scale (DeepSpeed fp16.loss_scale)",
        "training.loss_scale",
        type=float,
    ),
    accepted(
        "--initial-loss-scale",
        _MIXED,
        "fp16: a power of 2 (fp16.initial_scale_power); DeepSpeed's 2^16 when not given, as in Megatron-DeepSpeed",
        "training.initial_loss_scale",
        type=float,
    ),
    accepted("--min-loss-scale", _MIXED, "fp16: fp16.min_loss_scale", "training.min_loss_scale", type=float),
    accepted("--loss-scale-window", _MIXED, "fp16: fp16.loss_scale_window", "training.loss_scale_window", type=int),
    accepted(
        "--hysteresis",
        _MIXED,
        "fp16: fp16.hysteresis. The loss-scale flags are written into the DeepSpeed JSON; without --fp16 they are "
        "ignored with a warning",
        "training.hysteresis",
        type=int,
    ),
    no_op(
        "--no-query-key-layer-scaling",
        _MIXED,
        "query-key layer scaling divides the scores by the layer number and multiplies them back inside "
        "Megatron's fp16 softmax; the math is the identity, and SDPA scales by 1/sqrt(head dim) only",
    ),
    no_op(
        "--attention-softmax-in-fp32",
        _MIXED,
        "it switches Megatron's own fused softmax, which is not used: SDPA's fused kernels accumulate the softmax "
        "in fp32",
    ),
    no_op(
        "--accumulate-allreduce-grads-in-fp32",
        _MIXED,
        "DeepSpeed's bf16 optimizer accumulates gradients in fp32",
    ),
    refused("--fp32-residual-connection", _MIXED, "the residual stream stays in the training precision"),
    refused("--fp16-lm-cross-entropy", _MIXED, "the loss is always computed from fp32 logits"),
)
