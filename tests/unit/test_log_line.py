"""The log line's loss and iteration counts as Megatron's `training_log` keeps them: fp16 steps the loss scaler
skipped are left out of the mean loss and counted, and those with a NaN or Inf loss counted again."""

from __future__ import annotations

import math

import pytest

from megatron_ds.training import logger
from megatron_ds.training.step_report import StepResult, window_losses


def test_skipped_steps_leave_the_mean_and_nan_ones_are_counted() -> None:
    steps = [StepResult(2.0), StepResult(math.inf, skipped=True), StepResult(4.0), StepResult(3.0, skipped=True)]
    assert window_losses(steps) == (3.0, 2, 1)
    assert window_losses([StepResult(2.0), StepResult(4.0)]) == (3.0, 0, 0)
    assert window_losses([StepResult(math.nan, skipped=True)]) == (None, 1, 1)


def test_the_line_carries_megatrons_counts_and_no_loss_when_every_step_was_skipped() -> None:
    stats = logger.StepStats(8, 10, 64, 20.0, 1e-4, 8, 2.5, 1.0, 65536.0, 100.0, 0.0, skipped_iterations=1)
    line = logger.format_line(stats)
    assert "| lm loss: 2.500000E+00 |" in line
    assert "| number of skipped iterations:   1 | number of nan iterations:   0 |" in line
    none = logger.format_line(logger.StepStats(8, 10, 64, 20.0, 1e-4, 8, None, None, 65536.0, 100.0, 0.0, 0, 0))
    assert "lm loss" not in none and "loss scale: 65536.0" in none


@pytest.mark.parametrize("loss", [2.5, math.inf])
def test_tensorboard_gets_the_iterations_loss_and_the_window_no_loss(loss: float) -> None:
    """As Megatron's training_log: TensorBoard gets each iteration's own loss (a step the fp16 scaler skipped
    included), never the log window's mean, which only the line prints."""

    class Writer:
        def __init__(self) -> None:
            self.tags: dict[str, float] = {}

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.tags[tag] = value

    writer = Writer()
    scalars = logger.Scalars(writer, logger.LoggingConfig())
    scalars.window(logger.StepStats(8, 10, 64, 20.0, 1e-4, 8, 3.0, 1.0, None, 100.0, 0.0))
    assert "lm-loss-training/lm loss" not in writer.tags
    scalars.iteration(logger.IterationStats(8, 1e-4, 8, loss, 1.0, None))
    assert writer.tags["lm-loss-training/lm loss"] == loss


@pytest.mark.parametrize("fails", [False, True])
def test_pretrain_closes_the_profiler_and_writers_on_every_way_out(
    monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    """An error stop (a NaN loss, a bad token) still stops the profiler and flushes and closes the scalar writers,
    telling them the run failed (wandb marks it so); a finished run closes them as finished."""
    from types import SimpleNamespace

    from megatron_ds.training import loop

    closed: list[object] = []
    run = SimpleNamespace(
        state="state",
        hooks=SimpleNamespace(close=lambda: closed.append("hooks")),
        scalars=SimpleNamespace(close=lambda failed: closed.append(("scalars", failed))),
    )
    monkeypatch.setattr(loop, "setup", lambda config: run)

    def body(r: object) -> None:
        if fails:
            raise ValueError("iteration 2: lm loss nan")

    monkeypatch.setattr(loop, "_train_evaluate_save", body)
    if fails:
        with pytest.raises(ValueError, match="lm loss nan"):
            loop.pretrain(None)
    else:
        assert loop.pretrain(None) == "state"
    assert closed == ["hooks", ("scalars", fails)]
