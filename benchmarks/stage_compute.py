#!/usr/bin/env python
"""Predicted compute per spec and per stage, and the simulated step time, of the two models of
`benchmarks/stage_memory.py` (P = 5) under the stock, `both` and `memory` layouts, the split with
the smallest slowest stage (compute-balanced), and the fastest split that fits under no memory
limit, under the stock layout's largest stage and under a tight limit. Pure arithmetic, no run.

Stage time is FLOPs x a constant (1 GFLOP = 1 time unit; measured calibration comes later), so
only ratios mean anything: `step/ideal` is the simulated step of DeepSpeed's 1F1B schedule
(`megatron_ds/estimate/step_simulator.py`) over the step of the same total work split into P equal
stages (the schedule's bubble included); `step/stock` compares with DeepSpeed's default split.
Optimizer and communication time are left out (0).

    python benchmarks/stage_compute.py
    python benchmarks/stage_compute.py --models 48-layer --tight 1.05 --global-batch-size 16
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from stage_memory import COMMON, LAYOUTS, LIMITED, MODELS, NUM_STAGES  # noqa: E402 - the same models and layouts

from megatron_ds.config import Config  # noqa: E402
from megatron_ds.estimate.compute import ComputeInputs, spec_flops, stage_flops_for  # noqa: E402
from megatron_ds.estimate.machine import CPU  # noqa: E402
from megatron_ds.estimate.measured_time import stage_time_fn  # noqa: E402
from megatron_ds.estimate.memory_model import stage_memory_for  # noqa: E402
from megatron_ds.estimate.run_layout import build_run_layout, memory_inputs  # noqa: E402
from megatron_ds.estimate.step_simulator import balanced_step_time, simulate, step_estimator  # noqa: E402
from megatron_ds.flags.parser import parse_config  # noqa: E402
from megatron_ds.pipeline.balance import minimax_split  # noqa: E402
from megatron_ds.pipeline.costs import StageTime  # noqa: E402
from megatron_ds.pipeline.fastest import fastest_split  # noqa: E402
from megatron_ds.training.measure.calibrate import calibrate  # noqa: E402

GFLOP = 1e9
MIB = 2.0**20


def config_for(model: str, layout: str, extra: list[str]) -> Config:
    config, _ = parse_config(
        [*MODELS[model], *LAYOUTS[layout], *COMMON, *extra, "--print-layout"], world_size=NUM_STAGES
    )
    return config


def compute_inputs(config: Config) -> ComputeInputs:
    t = config.training
    return ComputeInputs(
        config.model,
        micro_batch_size=t.micro_batch_size,
        tensor_parallel_size=config.parallel.tensor_model_parallel_size,
        checkpoint_activations=t.checkpoint_activations,
        checkpoint_num_layers=t.checkpoint_num_layers,
    )


def spec_table(inputs: ComputeInputs) -> list[str]:
    specs = spec_flops(inputs)
    layer = next(sp for sp in specs if sp.group == "body")
    lines = [
        "per spec, one micro-batch (GFLOP; matmul = share of matmul FLOPs; x layer = forward + backward "
        "over one transformer layer's)",
        f"{'idx':>3} {'spec':<28} {'forward':>9} {'backward':>9} {'matmul':>7} {'x layer':>7}",
    ]
    for sp in specs:
        if sp.group == "body" and sp.index > layer.index:
            continue  # one row for the N identical layers
        total = sp.forward + sp.backward
        name = f"{sp.name} x {inputs.model.num_layers}" if sp.group == "body" else sp.name
        share = f"{(sp.matmul_forward + sp.matmul_backward) / total:>7.1%}" if total else f"{'-':>7}"
        lines.append(
            f"{sp.index:>3} {name:<28} {sp.forward / GFLOP:>9.4f} {sp.backward / GFLOP:>9.4f} {share} "
            f"{total / (layer.forward + layer.backward):>7.2f}"
        )
    return lines


StageTimeFn = Callable[[int, int], StageTime]


def flop_time(inputs: ComputeInputs) -> StageTimeFn:
    """Stage time = FLOPs / 1e9: one unit per GFLOP."""

    def stage_time(s: int, k: int) -> StageTime:
        st = stage_flops_for(inputs, s, NUM_STAGES, k)
        return StageTime(st.forward / GFLOP, st.backward_total / GFLOP)

    return stage_time


def measured_time(inputs: ComputeInputs) -> tuple[StageTimeFn, str]:
    """Stage time from `megatron_ds.estimate.calibrate` on this machine, in milliseconds, and a summary."""
    calibration = calibrate(inputs.model, inputs.micro_batch_size, repeats=5, warmup=2)
    seconds = stage_time_fn(calibration, inputs, NUM_STAGES)

    def stage_time(s: int, k: int) -> StageTime:
        t = seconds(s, k)
        return StageTime(1e3 * t.forward, 1e3 * t.backward)

    summary = "measured (forward + backward ms, GFLOP/s): " + ", ".join(
        f"{t.group} {1e3 * t.forward:.1f} + {1e3 * t.backward:.1f} ({t.flops_per_second / GFLOP:.1f})"
        for t in calibration.timings
    )
    return stage_time, summary


def times(stage_time: StageTimeFn, counts: list[int]) -> tuple[list[float], list[float]]:
    stages = [stage_time(s, k) for s, k in enumerate(counts)]
    return [t.forward for t in stages], [t.backward for t in stages]


def layout_row(name: str, counts: list[int], stage_time: StageTimeFn, config: Config, stock: float) -> str:
    m = config.grad_accumulation_steps
    fwd, bwd = times(stage_time, counts)
    step = simulate(m, fwd, bwd).step_time
    ideal = balanced_step_time(m, fwd, bwd)
    mem = memory_inputs(config, CPU)
    peak = max(stage_memory_for(mem, s, len(counts), k).total for s, k in enumerate(counts)) / MIB
    per_stage = " ".join(f"{f + b:6.2f}" for f, b in zip(fwd, bwd))
    shape = " ".join(f"{k:>2}" for k in counts)
    return (
        f"{name:<22} {shape:<15} {per_stage}  {peak:>9.1f} {step:>8.2f} {step / ideal:>10.3f} "
        f"{step / (stock or step):>10.3f}"
    )


def fastest(config: Config, stage_time: StageTimeFn, limit: float) -> list[int]:
    m, p, n = config.grad_accumulation_steps, NUM_STAGES, config.model.num_layers
    mem = memory_inputs(config, CPU)
    split = fastest_split(
        n, p, stage_time, lambda s, k: stage_memory_for(mem, s, p, k).total, limit, step_time=step_estimator(m)
    )
    return list(split.counts)


def report(model: str, tight: float, extra: list[str], measured: bool) -> str:
    configs = {name: config_for(model, name, extra) for name in LAYOUTS if name not in LIMITED}
    base = configs["stock"]
    inputs = compute_inputs(base)
    stage_time, summary = measured_time(inputs) if measured else (flop_time(inputs), "")
    unit = "ms (measured on this machine, one process)" if measured else "GFLOP"
    m, n = base.grad_accumulation_steps, base.model.num_layers
    lines = [
        f"model {model}: {' '.join([*MODELS[model], *extra])} (P={NUM_STAGES}, M={m} micro-batches per step, "
        f"{base.training.precision}, recompute {'on' if base.training.checkpoint_activations else 'off'})",
        *spec_table(inputs),
        *([summary] if summary else []),
        "",
        f"per stage: forward + backward of one micro-batch in {unit}; largest = predicted largest stage memory "
        f"(MiB); step in the same unit",
        f"{'layout':<22} {'layers':<15} {'stage time':<{7 * NUM_STAGES - 1}}  {'largest':>9} {'step':>8} "
        f"{'step/ideal':>10} {'step/stock':>10}",
    ]
    layouts = {name: list(build_run_layout(cfg, CPU).layers_per_stage) for name, cfg in configs.items()}
    fwd, bwd = times(stage_time, layouts["stock"])
    stock = simulate(m, fwd, bwd).step_time
    for name, counts in layouts.items():
        lines.append(layout_row(name, counts, stage_time, base, stock))

    def total(s: int, k: int) -> float:
        t = stage_time(s, k)
        return t.forward + t.backward

    slowest, _ = minimax_split(n, NUM_STAGES, total)
    lines.append(layout_row("min slowest stage", slowest, stage_time, base, stock))
    mem = memory_inputs(base, CPU)
    _, least = minimax_split(n, NUM_STAGES, lambda s, k: stage_memory_for(mem, s, NUM_STAGES, k).total)
    stock_peak = max(stage_memory_for(mem, s, NUM_STAGES, k).total for s, k in enumerate(layouts["stock"]))
    for limit in (math.inf, stock_peak, tight * least):
        name = "fastest (no limit)" if math.isinf(limit) else f"fastest (<= {limit / MIB:.0f} MiB)"
        lines.append(layout_row(name, fastest(base, stage_time, limit), stage_time, base, stock))
    lines.append(
        f"limits: none; the stock layout's largest stage; {tight:g} x {least / MIB:.1f} MiB, the least any split "
        f"needs on its largest stage. ideal step = {balanced_step_time(m, fwd, bwd):.2f} ((M + P - 1) x total / P)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--tight", type=float, default=1.02, help="tight limit as a multiple of the least peak")
    parser.add_argument("--global-batch-size", type=int, help="override the model's (more micro-batches per step)")
    parser.add_argument(
        "--measured", action="store_true", help="stage times from megatron_ds.estimate.calibrate, not FLOPs"
    )
    args = parser.parse_args(argv)
    extra = [] if args.global_batch_size is None else ["--global-batch-size", str(args.global_batch_size)]
    for model in args.models.split(","):
        if model not in MODELS:
            parser.error(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
        print(report(model, args.tight, extra, args.measured) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
