"""What a training step reports: its result (`StepResult`), the log line over a window of steps (Megatron's
`training_log` rules), the scalars TensorBoard and wandb get, and the memory and compute reports."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from megatron_ds.training import logger
from megatron_ds.training.grad_norm import grad_norm
from megatron_ds.training.measure import memory, stage_timers
from megatron_ds.training.run import Run, step_flops


@dataclass(frozen=True)
class StepResult:
    """What one training step reports to the log line."""

    loss: float
    skipped: bool = False
    """fp16's loss scaler skipped the update (DeepSpeed's `skipped_steps` grew)."""
    other_losses: dict[str, float] = dataclasses.field(default_factory=dict)
    """Losses beside the lm loss, by their name in the log line (`kd loss` under --kd)."""


def window_other_losses(steps: list[StepResult]) -> dict[str, float]:
    """The mean of each loss beside the lm loss over the updated steps (as `window_losses`)."""
    kept = [s.other_losses for s in steps if not s.skipped]
    return {name: sum(k[name] for k in kept) / len(kept) for name in (kept[0] if kept else {})}


def window_losses(steps: list[StepResult]) -> tuple[float | None, int, int]:
    """(mean loss of the updated steps or None, skipped steps, skipped steps with a NaN or Inf loss): Megatron's
    `training_log` rule, which leaves skipped iterations out of the loss and counts NaN among them."""
    kept = [s.loss for s in steps if not s.skipped]
    skipped = [s for s in steps if s.skipped]
    nan = sum(1 for s in skipped if not math.isfinite(s.loss))
    return (sum(kept) / len(kept) if kept else None), len(skipped), nan


def write_scalars(run: Run, step: StepResult, extras: dict[str, Any]) -> None:
    """The iteration's own values to TensorBoard and wandb (every --tensorboard-log-interval iterations, as
    Megatron's training_log), and the optimizer-state norms when asked for."""
    if not (run.is_logging_rank and run.scalars):
        return
    iteration = run.state.iteration
    run.scalars.iteration(
        logger.IterationStats(
            iteration=iteration,
            learning_rate=run.engine.get_lr()[0],
            global_batch_size=run.hooks.last.samples,
            loss=step.loss,
            other_losses=step.other_losses,
            grad_norm=grad_norm(run.engine),
            loss_scale=logger.loss_scale(run.engine),
            **extras,
        )
    )
    run.scalars.optimizer_states(run.engine, iteration)


def log_step(run: Run, steps: list[StepResult], seconds: float, start_iteration: int, extras: dict[str, Any]) -> None:
    cfg, state = run.config, run.state
    t = cfg.training
    n = len(steps)
    loss, skipped, nan = window_losses(steps)
    ms = 1000.0 * seconds / n
    done = state.iteration - start_iteration
    world = cfg.parallel.world_size or cfg.parallel.model_parallel_size
    size = run.hooks.last  # the last step's batch size and length (a ramp-up or curriculum changes them)
    flops = step_flops(cfg.model, size.seq_length, size.samples)
    tflops, mfu = logger.throughput(flops, seconds / n, world, run.peak_tflops)
    stats = logger.StepStats(
        iteration=state.iteration,
        train_iters=t.train_iters,
        consumed_samples=state.consumed_train_samples,
        elapsed_ms=ms,
        learning_rate=run.engine.get_lr()[0],
        global_batch_size=size.samples,
        loss=loss,
        other_losses=window_other_losses(steps),
        grad_norm=grad_norm(run.engine),
        loss_scale=logger.loss_scale(run.engine),
        tokens_per_second=run.hooks.take_window_tokens() / seconds,
        eta_s=(t.train_iters - state.iteration) * seconds / n if done else 0.0,
        tflops_per_gpu=tflops,
        mfu=mfu,
        skipped_iterations=skipped,
        nan_iterations=nan,
        **extras,
    )
    if run.is_logging_rank:
        print(logger.format_line(stats), flush=True)
        if run.scalars:
            run.scalars.window(stats)


def report_memory(run: Run, meter: memory.StepMeter) -> None:
    mine = meter.result(run.rank, run.engine.stage_id)
    everyone = memory.gather_report(mine)
    if run.scalars:
        run.scalars.memory(mine, run.state.iteration)
    if run.rank == 0:
        for m in everyone:
            print(m.format(run.state.iteration), flush=True)


def report_compute(run: Run) -> None:
    """Every rank's measured compute per step apart from its waiting, and the 1F1B step those times
    give with one device per stage (`stage_timers`), printed by rank 0."""
    everyone = stage_timers.gather(run.pipeline.timers.summary(run.rank))
    if run.rank == 0:
        print("\n".join(stage_timers.format_report(everyone)), flush=True)
