"""The NaN/Inf check of a training step (`training/finite_check.py`); a run it stops: tests/e2e/test_pretrain_gpt.py."""

from __future__ import annotations

import math

import pytest

from megatron_ds.config import Config, ModelConfig, TrainingConfig
from megatron_ds.training.finite_check import NonFiniteStep, check_step, checking


class Engine:
    def __init__(self, fp16: bool, dynamic: bool) -> None:
        self.fp16, self.dynamic = fp16, dynamic

    def fp16_enabled(self) -> bool:
        return self.fp16

    def dynamic_loss_scale(self) -> bool:
        return self.dynamic


def config(check: bool = True) -> Config:
    model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128, seq_length=16,
                        max_position_embeddings=16, vocab_size=128)  # fmt: skip
    return Config(model=model, training=TrainingConfig(check_for_nan_in_loss_and_grad=check))


def test_checked_unless_turned_off_or_fp16_with_dynamic_loss_scaling() -> None:
    assert checking(config(), Engine(fp16=False, dynamic=False))  # fp32 and bf16
    assert checking(config(), Engine(fp16=True, dynamic=False))  # a static --loss-scale: checked, as Megatron-LM
    assert not checking(config(), Engine(fp16=True, dynamic=True))  # the scaler skips overflowing steps
    assert not checking(config(check=False), Engine(fp16=False, dynamic=False))


@pytest.mark.parametrize(
    "loss, norm, named",
    [
        (math.nan, 1.0, "iteration 7: lm loss nan; the run stops here without saving"),
        (2.0, math.inf, "iteration 7: grad norm inf; the run stops"),
        (math.inf, math.nan, "iteration 7: lm loss inf and grad norm nan;"),
        (math.nan, None, "iteration 7: lm loss nan;"),  # a path without a norm checks the loss
    ],
)
def test_a_non_finite_step_is_one_line_naming_the_values_and_the_way_on(loss: float, norm: float | None, named: str):
    with pytest.raises(NonFiniteStep) as err:
        check_step(7, loss, norm)
    message = str(err.value)
    assert message.startswith(named) and "\n" not in message
    assert message.endswith("give --no-check-for-nan-in-loss-and-grad to train on")


def test_finite_steps_pass() -> None:
    check_step(1, 3.2, 0.5)
    check_step(1, 3.2, None)
