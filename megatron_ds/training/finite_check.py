"""Megatron-LM's NaN/Inf check, on by default (`--no-check-for-nan-in-loss-and-grad` turns it off): the first
training step whose loss or global gradient norm is NaN or Inf stops the run with one line, before anything is
saved, so the last checkpoint is the one from before it. A non-finite gradient reaches the weights (bf16 and fp32
steps are not skipped), and every later step would train a broken model.

Every rank stops at the same step, so no collective is left waiting: the loss each rank sees is the step's mean
over data-parallel ranks (DeepSpeed's pipeline engine sends the last stage's to every stage; `PlainEngine`
averages it), and the gradient norm is the global one. Under fp16 with dynamic loss scaling the check is off, as
Megatron-LM turns it off: an overflow there is the scaler's signal, and DeepSpeed skips that step.
"""

from __future__ import annotations

import math
from typing import Any

from megatron_ds.config import Config
from megatron_ds.errors import UserError


class NonFiniteStep(UserError):
    """A training step's loss or gradient norm is NaN or Inf."""


def checking(config: Config, engine: Any) -> bool:
    """Whether this run's steps are checked (see the module docstring)."""
    dynamic_fp16 = engine.fp16_enabled() and engine.dynamic_loss_scale()
    return config.training.check_for_nan_in_loss_and_grad and not dynamic_fp16


def check_step(iteration: int, loss: float, grad_norm: float | None) -> None:
    """NonFiniteStep when `loss` or `grad_norm` (None: not computed) is not finite."""
    bad = [] if math.isfinite(loss) else [f"lm loss {loss}"]
    if grad_norm is not None and not math.isfinite(grad_norm):
        bad.append(f"grad norm {grad_norm}")
    if bad:
        raise NonFiniteStep(
            f"iteration {iteration}: {' and '.join(bad)}; the run stops here without saving (the last checkpoint "
            "is from before this step). Lower --lr or check the data, or give --no-check-for-nan-in-loss-and-grad "
            "to train on"
        )
