"""The training loop on DeepSpeed's pipeline engine, as named steps."""

from __future__ import annotations

import datetime
import os
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from megatron_ds import files
from megatron_ds.config import Config
from megatron_ds.estimate.devices import peak_tflops
from megatron_ds.pipeline.layout import Layout
from megatron_ds.training import determinism, finite_check, logger, progress_log, scalar_writers, signals
from megatron_ds.training.builder import Pipeline, build_pipeline
from megatron_ds.training.checkpoint import save_load
from megatron_ds.training.grad_norm import grad_norm
from megatron_ds.training.lr_schedule import LRSchedule
from megatron_ds.training.measure import memory
from megatron_ds.training.preflight import install_stack_dump_handler
from megatron_ds.training.resolve_layout import layout_text
from megatron_ds.training.run import Run, step_flops
from megatron_ds.training.run_data import build_run_data
from megatron_ds.training.state import TrainState
from megatron_ds.training.step_hooks import StepHooks
from megatron_ds.training.step_report import StepResult, log_step, report_compute, report_memory, write_scalars


def set_seeds(seed: int) -> None:
    """The same seeds on every rank (weights are seeded per spec; this covers dropout and data)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def print_rank0(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def setup(config: Config) -> Run:
    """Process group, seeds, engine, checkpoint, data: everything before the first step."""
    import torch.distributed as dist

    from megatron_ds.distributed import init_distributed

    start_time = time.time()
    install_stack_dump_handler()
    if config.checkpoint.save:
        save_load.check_writable(config.checkpoint.save)
    if config.training.deterministic_mode:
        determinism.apply()  # before NCCL and cuBLAS start
    init_distributed(config.parallel)
    rank = dist.get_rank()
    if config.logging.log_progress and config.checkpoint.save and rank == 0:
        progress_log.append(config.checkpoint.save, dist.get_world_size(), progress_log.STARTING)
    set_seeds(config.training.seed)
    pipeline = build_pipeline(
        config,
        lr_scheduler=lambda opt: LRSchedule.from_config(opt, config),
        on_layout=lambda layout, calibration: (
            print_rank0(rank, layout_text(config, layout, calibration))
            if rank == 0  # the table and its notices (which may build the tokenizer) on the printing rank only
            else None
        ),
    )
    layout = pipeline.layout
    state = _load_or_fresh(config, layout, pipeline, rank)
    is_logging_rank = rank == dist.get_world_size() - 1
    peak = _peak_tflops(config)
    run = Run(
        config=config,
        layout=layout,
        pipeline=pipeline,
        state=state,
        watchdog=pipeline.watchdog,
        rank=rank,
        is_logging_rank=is_logging_rank,
        data=build_run_data(config, pipeline.engine, state),
        start_time=start_time,
        start_flops=state.floating_point_operations_so_far,
        peak_tflops=peak,
        hooks=StepHooks(config, pipeline.engine, rank),
    )
    run.data.train = run.hooks.train_batches(run.data.train)
    writer = scalar_writers.open_writers(config) if run.is_logging_rank else None
    if writer is not None:
        run.scalars = logger.Scalars(writer, config.logging, dist.get_world_size())
    return run


def _peak_tflops(config: Config) -> float | None:
    if config.logging.peak_tflops is not None:
        return config.logging.peak_tflops
    if not torch.cuda.is_available():
        return None
    return peak_tflops(torch.cuda.get_device_name(), config.training.precision)


def _load_or_fresh(config: Config, layout: Layout, pipeline: Pipeline, rank: int) -> TrainState:
    if config.checkpoint.save and rank == 0:
        save_load.remove_incomplete(config.checkpoint.save)
    if not config.checkpoint.load:
        return TrainState()
    state = save_load.load(pipeline.engine, config, layout, config.checkpoint.load)
    if state is None:  # a first launch: check_launch printed its notice
        return TrainState()
    print_rank0(
        rank,
        f"resumed from {config.checkpoint.load} at iteration {state.iteration} "
        f"({state.consumed_train_samples} samples consumed)",
    )
    if config.data.prompt_data and config.data.repeated_dataloader and state.consumed_train_samples:
        print_rank0(
            rank,
            f"NOTICE: --repeated-dataloader: resumed after {state.consumed_train_samples} samples, the examples are "
            "read on as in an uninterrupted run (Megatron-DeepSpeed's loader would restart each later pass at that "
            "sample)",
        )
    return state


def train_step(run: Run) -> StepResult:
    size = run.hooks.before_step(run.state)
    skipped_before = getattr(run.engine, "skipped_steps", 0)
    with run.watchdog.watch(f"train_batch at iteration {run.state.iteration + 1}"):
        loss = run.engine.train_batch(data_iter=run.data.train)
    run.state.iteration += 1
    run.state.consumed_train_samples += size.samples
    run.state.consumed_train_tokens += size.tokens
    run.state.floating_point_operations_so_far += step_flops(run.config.model, size.seq_length, size.samples)
    trace = run.hooks.after_step(run.state)
    if trace:
        print(f"[rank {run.rank}] wrote the --profile trace {trace}", flush=True)
    other = {name: float(value.item()) for name, value in getattr(run.engine, "step_losses", {}).items()}
    return StepResult(float(loss.item()), getattr(run.engine, "skipped_steps", 0) > skipped_before, other)


def evaluate(run: Run, name: str, data_iter: Iterator[Any] | None, num_batches: int) -> float:
    run.hooks.before_eval()
    losses = []
    for i in range(num_batches):
        with run.watchdog.watch(f"{name} eval_batch {i}"):
            losses.append(float(run.engine.eval_batch(data_iter=data_iter).item()))
    run.data.stop_if_bad()
    run.hooks.after_eval()
    if name == "validation":  # at the step's batch size, as Megatron (a ramp-up changes it)
        run.state.consumed_valid_samples += num_batches * run.engine.train_batch_size()
    loss = sum(losses) / len(losses)
    if run.is_logging_rank:
        print(logger.format_eval(name, run.state.iteration, loss), flush=True)
        if run.scalars and not run.config.training.skip_train:  # upstream's write_to_tensorboard=not skip_train
            run.scalars.eval(name, run.state.iteration, loss)
    return loss


def _in_next_iteration(state: TrainState) -> Callable[[], str]:
    """Where the loop is between saves, for the line a stopping signal prints."""
    return lambda: f"in iteration {state.iteration + 1}"


def save(run: Run) -> None:
    ck, state = run.config.checkpoint, run.state
    # a stopping signal says what it interrupted: this save (the last complete checkpoint is kept), not an iteration
    signals.set_progress(lambda: f"while saving the checkpoint of iteration {state.iteration} (left incomplete)")
    with run.watchdog.watch(f"save_checkpoint at iteration {run.state.iteration}"):
        try:
            tag = save_load.save(run.engine, run.config, run.layout, run.state, ck.save)
        except (OSError, RuntimeError) as err:  # a full disk: torch's writer says 'iostream error', not ENOSPC
            failure = files.write_failure(err)
            if failure is None:
                raise
            raise save_load.save_failed(ck.save, state.iteration, failure) from None
    signals.set_progress(_in_next_iteration(state))
    print_rank0(run.rank, f"saved checkpoint {os.path.join(ck.save, tag)} at iteration {run.state.iteration}")
    if run.config.logging.log_progress and run.rank == 0:  # after the save, as Megatron-LM
        import torch.distributed as dist

        state, now, world = run.state, datetime.datetime.now(), dist.get_world_size()
        text = progress_log.saved_line(
            state.iteration,
            state.floating_point_operations_so_far,
            state.floating_point_operations_so_far - run.start_flops,
            time.time() - run.start_time,
            world,
            state.consumed_train_tokens,
            progress_log.start_of_world_size(ck.save, world),
            now,
        )
        progress_log.append(ck.save, world, text, now)


def _on_some_rank(run: Run, found: bool) -> bool:
    """`found` on any rank (a max all-reduce: every rank gets the same answer)."""
    import torch.distributed as dist

    flag = torch.tensor([float(found)], device=run.engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def time_is_up(run: Run) -> bool:
    """`--exit-duration-in-mins` has passed on some rank (every rank agrees)."""
    limit = run.config.training.exit_duration_in_mins
    return bool(limit) and _on_some_rank(run, time.time() - run.start_time > 60.0 * limit)


def kill_switch(run: Run) -> bool:
    """`--kill-switch-file` exists, as some rank sees it (every rank agrees: a file appearing between two ranks'
    looks stops them all at the same step)."""
    path = run.config.training.kill_switch_file
    return bool(path) and _on_some_rank(run, os.path.exists(path))


def train(run: Run) -> bool:
    """Iterate to --train-iters, logging, evaluating and saving at their intervals.

    Returns True when it stopped because of --exit-interval, --exit-duration-in-mins, --kill-switch-file or a
    SIGTERM under --exit-signal-handler (the caller then saves and skips the final evaluation, as Megatron exits
    right after saving)."""
    cfg, state = run.config, run.state
    t, ck, lg = cfg.training, cfg.checkpoint, cfg.logging
    start_iteration = state.iteration
    meter = memory.StepMeter(run.engine) if lg.log_memory else None
    # Memory is measured on the step that ends the first log interval; the allocation trace starts
    # one step earlier when there is one (see allocation_trace.CpuAllocationTrace); no other step is.
    measured_iteration = min(t.train_iters, (start_iteration // lg.log_interval + 1) * lg.log_interval)
    memory_reported = not lg.log_memory
    # Stage compute is timed on the other steps (not the process's first, not the profiled ones) and
    # reported beside the memory, at the first log line after a timed step.
    profiled = {measured_iteration - 1, measured_iteration} if meter is not None else set()
    compute_reported = False
    steps: list[StepResult] = []
    scalars_asked = scalar_writers.asked_for(cfg)  # the same on every rank: the extras below are collective
    window_start = time.time()
    signals.set_progress(_in_next_iteration(state))
    while state.iteration < t.train_iters:
        if kill_switch(run):
            print_rank0(
                run.rank, f"exiting at iteration {state.iteration}: found --kill-switch-file {t.kill_switch_file}"
            )
            return True
        step = state.iteration + 1
        timed = step != start_iteration + 1 and step not in profiled
        with memory.step_context(meter, step, measured_iteration), run.pipeline.timers.counting(timed):
            steps.append(train_step(run))
        run.data.stop_if_bad()  # a sample outside the vocabulary, on any rank: all stop here
        if finite_check.checking(cfg, run.engine):
            finite_check.check_step(state.iteration, steps[-1].loss, grad_norm(run.engine))
        log_now = state.iteration % lg.log_interval == 0 or state.iteration == t.train_iters
        scalars_now = scalars_asked and state.iteration % lg.tensorboard_log_interval == 0
        extras = run.hooks.log_extras() if log_now or scalars_now else {}
        if scalars_now:
            write_scalars(run, steps[-1], extras)
        if log_now:
            log_step(run, steps, time.time() - window_start, start_iteration, extras)
            steps = []
            if not memory_reported:
                report_memory(run, meter)
                memory_reported = True
            if not compute_reported and (run.pipeline.timers.steps or state.iteration == t.train_iters):
                report_compute(run)
                compute_reported = True
            window_start = time.time()
        if t.eval_iters and t.eval_interval and state.iteration % t.eval_interval == 0 and run.data.has_valid:
            evaluate(run, "validation", run.data.valid, t.eval_iters)
        if ck.save and ck.save_interval and state.iteration % ck.save_interval == 0:
            save(run)
        if time_is_up(run):
            minutes = (time.time() - run.start_time) / 60.0
            print_rank0(
                run.rank,
                f"exiting at iteration {state.iteration} after {minutes:.1f} minutes "
                f"(--exit-duration-in-mins {t.exit_duration_in_mins:g})",
            )
            return True
        if signals.stop_requested(t.exit_signal_handler, run.engine.device, run.watchdog):
            print_rank0(run.rank, f"exiting at iteration {state.iteration} after SIGTERM (--exit-signal-handler)")
            return True
        if t.exit_interval and state.iteration % t.exit_interval == 0:
            print_rank0(run.rank, f"exiting at iteration {state.iteration} (--exit-interval)")
            return True
    return False


def pretrain(config: Config) -> TrainState:
    """The whole job: set up, train, final evaluation on validation and test, final save."""
    run = setup(config)
    failed = True
    try:
        _train_evaluate_save(run)
        failed = False
    finally:
        close_outputs(run, failed)
    return run.state


def _train_evaluate_save(run: Run) -> None:
    t, ck = run.config.training, run.config.checkpoint
    start = run.state.iteration
    if t.skip_train:
        print_rank0(run.rank, "skipping training (--skip-train is on) ...")
    out_of_time = train(run) if start < t.train_iters and not t.skip_train else False
    if (
        ck.save
        and run.state.iteration > start
        and not (ck.save_interval and run.state.iteration % ck.save_interval == 0)
    ):
        save(run)
    if t.eval_iters and not out_of_time:
        just_evaluated = run.state.iteration > start and t.eval_interval and run.state.iteration % t.eval_interval == 0
        if run.data.has_valid and not just_evaluated:
            evaluate(run, "validation", run.data.valid, t.eval_iters)
        test_iter = run.data.test_batches()
        if run.data.test_dataset is not None:
            evaluate(run, "test", test_iter, t.eval_iters)


def close_outputs(run: Run, failed: bool) -> None:
    """Stop the profiler and close the scalar writers on every way out, an error stop (a NaN loss, a bad token, a
    stall) included: a buffered writer's last events reach the disk, and a wandb run is finished as failed (the
    process leaves through `os._exit`, so wandb's own exit hook would only see its atexit call, not the status)."""
    try:
        run.hooks.close()
    finally:
        if run.scalars:
            run.scalars.close(failed=failed)
