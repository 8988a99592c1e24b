#!/usr/bin/env python
"""Measured per-stage memory and compute of a GPT with a large embedding under several pipeline
layouts on CPU, next to what the memory model and the calibrated compute model predict.

For each model and layout this runs `pretrain_gpt.py` on 5 CPU ranks (`--stages N`: N) (torchrun, gloo, fp32,
`--mock-data`) for 10 iterations with `--log-interval 8`. From its output:

- memory: the report of iteration 8 (`megatron_ds/training/measure/memory.py`, the code `--log-memory`
  runs; it traces iterations 7-8), against the memory model (`estimate/memory_model.py`);
- compute: each stage's CPU time per step in forward, backward and optimizer instructions
  (`training/measure/stage_timers.py`; the median of iterations 2-6, untraced), against the calibrated prediction
  (`estimate/calibrate.py`: each group timed once in this process, before the runs, same clock);
- the 1F1B step DeepSpeed's schedule takes with one device per stage, simulated from the measured
  compute (`estimate/step_simulator.py`), over the ideal: the same compute in P equal stages through the
  same schedule. Wall-clock steps are printed too; with 5 ranks on 2 shared cores they are noise.

    python benchmarks/stage_memory.py                               # both models, every layout
    python benchmarks/stage_memory.py --models 48-layer             # the issue's benchmark (~12 min on 2 cores)
    python benchmarks/stage_memory.py --models 8-layer --layouts stock,memory
    python benchmarks/stage_memory.py --stages 2 --models 48-layer --layouts 'stock,layout:Et*30|t*18L'

Layouts: `stock` is DeepSpeed's `type:transformer` split (our default), `both` is
`--pp-dedicated-embedding-stages both`, `memory` is `--pp-partition-method memory`, `fastest` and
`profile` are those methods under `--pp-memory-limit` = the stock layout's predicted largest stage
(FLOP-based stage times, or times measured by each run's rank 0 before it builds the layout).
`layout:STRING` runs `--pp-layout STRING` (any split, to test the compute prediction on it).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NUM_STAGES = 5
MIB = 1024.0 * 1024.0
ITERATIONS, LOG_INTERVAL = 10, 8

MODELS = {
    # The example size: 8 layers cannot balance a 32k x 512 embedding (see docs/layouts.md).
    "8-layer": "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 128 --vocab-size 32000 "
    "--micro-batch-size 2 --global-batch-size 8".split(),
    # Deep enough for the memory layout to balance the embedding and head stages.
    "48-layer": "--num-layers 48 --hidden-size 384 --num-attention-heads 8 --seq-length 128 --vocab-size 32000 "
    "--micro-batch-size 1 --global-batch-size 4".split(),
}
LAYOUTS = {
    "stock": [],  # --pp-partition-method type:transformer, DeepSpeed's default split
    "both": ["--pp-dedicated-embedding-stages", "both"],
    "memory": ["--pp-partition-method", "memory"],
    "fastest": ["--pp-partition-method", "fastest"],
    "profile": ["--pp-partition-method", "profile"],
}
LIMITED = ("fastest", "profile")


def common_flags(num_stages: int) -> list[str]:
    return (
        f"--pipeline-model-parallel-size {num_stages} --mock-data --train-iters {ITERATIONS} --log-interval "
        f"{LOG_INTERVAL} --eval-iters 0 --lr 1e-4 --num-workers 0 --hidden-dropout 0 --attention-dropout 0 --seed 1234 "
        f"--distributed-timeout-minutes 10"
    ).split()


COMMON = common_flags(NUM_STAGES)


def set_stages(num_stages: int) -> None:
    """Run every layout on `num_stages` ranks (P = num_stages) instead of 5."""
    global NUM_STAGES, COMMON
    NUM_STAGES, COMMON = num_stages, common_flags(num_stages)


REPORT = re.compile(
    r"\[Rank (\d+) \| stage (\d+)\] \(after \d+ iterations\) memory \(MB\) \| params: ([\d.]+) \| "
    r"grads: ([\d.]+) \| optimizer: ([\d.]+) \| activations \(peak saved\): ([\d.]+) \| "
    r"other \(buffers, transients\): (-?[\d.]+) \| total \(measured peak\): ([\d.]+)"
)
COMPUTE = re.compile(
    r"\[Rank \d+ \| stage (\d+)\] compute per step \(CPU time, ms, median of (\d+) step\(s\)\) \| forward: ([\d.]+) \| "
    r"backward: ([\d.]+) \| optimizer: ([\d.]+) \|"
)
STEP = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")
LAYOUT = re.compile(r"transformer layers per stage: ([\d ]+) \(layout (\S+), method")


@dataclass
class StageRow:
    stage: int
    layers: int
    params: float
    grads: float
    optimizer: float
    activations: float
    other: float
    measured: float
    predicted: float
    """Memory, MiB."""
    forward: float
    backward: float
    optimizer_time: float
    """Measured CPU time per step, ms."""
    predicted_compute: float
    """Calibrated prediction per step, ms."""

    @property
    def compute(self) -> float:
        return self.forward + self.backward + self.optimizer_time


@dataclass
class LayoutRun:
    model: str
    layout_name: str
    layout: str
    step_ms: float
    timed_steps: int
    rows: list[StageRow]
    command: str

    @property
    def totals(self) -> list[float]:
        return [r.measured for r in self.rows]


@dataclass
class Predictor:
    """The memory model and the calibrated compute model for one model's runs (no torch.distributed)."""

    model: str
    config: object
    calibration: object
    limit_mib: float

    @classmethod
    def for_model(cls, model: str) -> Predictor:
        from megatron_ds.flags.parser import parse_config
        from megatron_ds.training.measure.calibrate import calibrate

        config, _ = parse_config([*MODELS[model], *COMMON, "--print-layout"], world_size=NUM_STAGES)
        t = config.training
        calibration = calibrate(config.model, t.micro_batch_size, repeats=7, warmup=2, device="cpu")
        return cls(model, config, calibration, stock_limit_mib(config))

    def memory(self, counts: list[int]) -> list[float]:
        from megatron_ds.estimate.machine import CPU
        from megatron_ds.estimate.memory_model import stage_memory_for
        from megatron_ds.estimate.run_layout import memory_inputs

        mem = memory_inputs(self.config, CPU)
        return [stage_memory_for(mem, s, NUM_STAGES, k).total / MIB for s, k in enumerate(counts)]

    def compute(self, counts: list[int]) -> list[float]:
        """Per stage: M x (forward + backward) + optimizer, ms, from the calibration."""
        from megatron_ds.estimate.layout_costs import compute_inputs
        from megatron_ds.estimate.machine import CPU
        from megatron_ds.estimate.measured_time import stage_time_fn
        from megatron_ds.estimate.run_layout import memory_inputs

        stage_time = stage_time_fn(self.calibration, compute_inputs(memory_inputs(self.config, CPU)), NUM_STAGES)
        m = self.config.grad_accumulation_steps
        return [
            1e3 * (m * (t.forward + t.backward) + t.optimizer) for t in (stage_time(s, k) for s, k in enumerate(counts))
        ]


EXPLICIT = "layout:"
"""`--layouts` entries that start with this name a layout string."""


def layout_flags(layout: str) -> list[str]:
    return ["--pp-layout", layout.removeprefix(EXPLICIT)] if layout.startswith(EXPLICIT) else LAYOUTS[layout]


def stock_limit_mib(config: object) -> float:
    """The `fastest` / `profile` memory limit: the stock split's predicted largest stage, MiB."""
    from megatron_ds.estimate.machine import CPU
    from megatron_ds.estimate.memory_model import stage_memory_for
    from megatron_ds.estimate.run_layout import build_run_layout, memory_inputs

    mem = memory_inputs(config, CPU)
    stock = build_run_layout(config, CPU).layers_per_stage
    return max(stage_memory_for(mem, s, NUM_STAGES, k).total for s, k in enumerate(stock)) / MIB


def layout_error(model: str, layout: str) -> str | None:
    """What pretrain_gpt.py would refuse about `layout` for `model` (None: it builds)."""
    from megatron_ds.errors import UserError
    from megatron_ds.estimate.machine import CPU
    from megatron_ds.estimate.run_layout import build_run_layout
    from megatron_ds.flags.parser import parse_config

    try:
        config, _ = parse_config([*MODELS[model], *layout_flags(layout), *COMMON, "--print-layout"], NUM_STAGES)
        build_run_layout(config, CPU)
    except UserError as e:
        return str(e)
    return None


def argv_for(model: str, layout: str, limit_mib: float) -> list[str]:
    limit = ["--pp-memory-limit", f"{math.ceil(10 * limit_mib) / 10:.1f}MiB"] if layout in LIMITED else []
    return [*MODELS[model], *layout_flags(layout), *limit, *COMMON]


def run_layout(predictor: Predictor, layout: str, timeout: float) -> LayoutRun:
    from megatron_ds.testing.launch import run_torchrun

    model = predictor.model
    argv = argv_for(model, layout, predictor.limit_mib)
    out = run_torchrun(NUM_STAGES, [str(ROOT / "pretrain_gpt.py"), *argv], timeout=timeout, cwd=str(ROOT))
    text = out.stdout
    if out.returncode != 0:
        raise RuntimeError(f"{model} / {layout}: pretrain_gpt.py exited {out.returncode}:\n{text[-4000:]}")
    printed = LAYOUT.search(text)
    counts = [int(k) for k in printed.group(1).split()]  # what the run built (profile measures at run time)
    reports = {int(m.group(2)): m for m in REPORT.finditer(text)}
    compute = {int(m.group(1)): m for m in COMPUTE.finditer(text)}
    if sorted(reports) != list(range(NUM_STAGES)) or sorted(compute) != list(range(NUM_STAGES)):
        raise RuntimeError(f"{model} / {layout}: memory or compute report lines missing:\n{text[-4000:]}")
    memory, predicted_compute = predictor.memory(counts), predictor.compute(counts)
    rows = []
    for s in range(NUM_STAGES):
        v = [float(x) for x in reports[s].groups()[2:]]  # the report's "MB" are 2**20 bytes, as Megatron's
        fwd, bwd, opt = (float(x) for x in compute[s].groups()[2:])
        rows.append(StageRow(s, counts[s], *v, memory[s], fwd, bwd, opt, predicted_compute[s]))
    untraced = [float(m.group(2)) for m in STEP.finditer(text) if int(m.group(1)) > LOG_INTERVAL]
    steps = int(compute[0].group(2))
    command = f"torchrun --nproc_per_node {NUM_STAGES} pretrain_gpt.py " + shlex.join(argv)
    name = "given" if layout.startswith(EXPLICIT) else layout  # the table's 8-character column; the string follows
    return LayoutRun(model, name, printed.group(2), min(untraced, default=float("nan")), steps, rows, command)


def simulated(run: LayoutRun, m: int, which: str = "measured") -> tuple[float, float]:
    """(1F1B step, ideal) in ms from the measured (or predicted) per-stage compute."""
    from megatron_ds.estimate.step_simulator import balanced_step_time, simulate

    if which == "measured":
        fwd = [r.forward / m for r in run.rows]
        bwd = [r.backward / m for r in run.rows]
        opt = [r.optimizer_time for r in run.rows]
    else:  # predicted totals split as the measured ones are (forward : backward : optimizer)
        scale = [r.predicted_compute / r.compute for r in run.rows]
        fwd = [r.forward / m * f for r, f in zip(run.rows, scale)]
        bwd = [r.backward / m * f for r, f in zip(run.rows, scale)]
        opt = [r.optimizer_time * f for r, f in zip(run.rows, scale)]
    step = simulate(m, fwd, bwd, opt).step_time
    return step, balanced_step_time(m, fwd, bwd) + sum(opt) / len(opt)


def format_memory(runs: list[LayoutRun]) -> str:
    """Per model: every layout's stages, measured and predicted memory, ratio to the median stage."""
    head = (
        f"{'layout':<8} {'stage':>5} {'layers':>6} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} "
        f"{'other':>8} {'measured':>9} {'predicted':>9} {'pred/meas':>9} {'/median':>7}"
    )
    lines = [
        f"model {runs[0].model}: {' '.join(MODELS[runs[0].model])} (MiB; {NUM_STAGES} CPU ranks, fp32, ZeRO-0)",
        head,
    ]
    for run in runs:
        median = statistics.median(run.totals)
        for r in run.rows:
            lines.append(
                f"{run.layout_name:<8} {r.stage:>5} {r.layers:>6} {r.params:>8.1f} {r.grads:>8.1f} "
                f"{r.optimizer:>8.1f} {r.activations:>8.1f} {r.other:>8.1f} {r.measured:>9.1f} "
                f"{r.predicted:>9.1f} {r.predicted / r.measured:>9.3f} {r.measured / median:>7.2f}"
            )
        ends = max(run.totals[0], run.totals[-1]) / median
        errors = max(abs(r.predicted / r.measured - 1) for r in run.rows)
        lines.append(
            f"{run.layout_name:<8} layout {run.layout}: max/min {max(run.totals) / min(run.totals):.3f}, "
            f"first-or-last/median {ends:.2f}, worst prediction error {errors:.1%}"
        )
    return "\n".join(lines)


def format_compute(runs: list[LayoutRun], m: int, limit_mib: float) -> str:
    """Per model: every layout's measured and predicted compute per stage, and the simulated steps."""
    head = (
        f"{'layout':<8} {'stage':>5} {'layers':>6} {'forward':>8} {'backward':>8} {'optim':>7} {'compute':>8} "
        f"{'predicted':>9} {'pred/meas':>9} {'share':>6} {'memory':>7} {'predicted':>9}"
    )
    lines = [
        f"model {runs[0].model}: compute per step in ms of CPU time (measured: stage timers; predicted: calibrated "
        f"in one process), memory in MiB; fastest/profile limit {limit_mib:.1f} MiB",
        head,
    ]
    by_name = {r.layout_name: r for r in runs}
    for run in runs:
        scale = sum(r.compute for r in run.rows) / sum(r.predicted_compute for r in run.rows)
        for r in run.rows:
            lines.append(
                f"{run.layout_name:<8} {r.stage:>5} {r.layers:>6} {r.forward:>8.1f} {r.backward:>8.1f} "
                f"{r.optimizer_time:>7.1f} {r.compute:>8.1f} {r.predicted_compute:>9.1f} "
                f"{r.predicted_compute / r.compute:>9.3f} {scale * r.predicted_compute / r.compute:>6.3f} "
                f"{r.measured:>7.1f} {r.predicted:>9.1f}"
            )
        step, ideal = simulated(run, m)
        pstep, pideal = simulated(run, m, "predicted")
        worst = max(abs(r.predicted_compute / r.compute - 1) for r in run.rows)
        worst_share = max(abs(scale * r.predicted_compute / r.compute - 1) for r in run.rows)
        vs = ", ".join(
            f"{step / simulated(other, m)[0]:.3f} x {name}"
            for name, other in by_name.items()
            if name in ("stock", "memory")
        )
        lines.append(
            f"{run.layout_name:<8} layout {run.layout}: simulated step {step:.0f} ms = {step / ideal:.3f} x ideal "
            f"({ideal:.0f} ms); {vs}; predicted {pstep / pideal:.3f} x ideal; worst compute prediction error "
            f"{worst:.1%} ({worst_share:.1%} of the stage's share); largest stage {max(run.totals):.1f} MiB; wall step here {run.step_ms:.0f} ms; "
            f"{run.timed_steps} timed step(s)"
        )
    return "\n".join(lines)


def render(path: Path) -> int:
    """The tables of a `--json` file (same numbers, no run)."""
    from megatron_ds.flags.parser import parse_config

    runs = [LayoutRun(**{**d, "rows": [StageRow(**r) for r in d["rows"]]}) for d in json.loads(path.read_text())]
    for model in dict.fromkeys(r.model for r in runs):
        mine = [r for r in runs if r.model == model]
        config, _ = parse_config([*MODELS[model], *COMMON, "--print-layout"], world_size=NUM_STAGES)
        print(format_memory(mine) + "\n")
        print(format_compute(mine, config.grad_accumulation_steps, stock_limit_mib(config)) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {', '.join(LAYOUTS)}")
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pretrain_gpt.py run")
    parser.add_argument("--render", type=Path, help="print the tables of an earlier --json file instead of running")
    parser.add_argument(
        "--stages",
        type=int,
        default=NUM_STAGES,
        help="pipeline stages = ranks per run (5; 2 gives each rank a core of a 2-core machine)",
    )
    args = parser.parse_args(argv)
    set_stages(args.stages)
    if args.render:
        return render(args.render)
    models, layouts = args.models.split(","), args.layouts.split(",")
    for names, known, extra in ((models, MODELS, ""), (layouts, LAYOUTS, f" or {EXPLICIT}STRING")):
        bad = [n for n in names if n not in known and not (extra and n.startswith(EXPLICIT))]
        if bad:
            parser.error(f"unknown {bad}; choose from {', '.join(known)}{extra}")
    for model in models:  # a bad layout string fails here, in one line, before any calibration or run
        for layout in (n for n in layouts if n.startswith(EXPLICIT)):
            if error := layout_error(model, layout):
                parser.error(f"{model} / {layout}: {error}")
    results = []
    start = time.time()
    for model in models:
        predictor = Predictor.for_model(model)
        runs = []
        for layout in layouts:
            runs.append(run_layout(predictor, layout, args.timeout))
            print(f"  ran {model} / {layout} ({time.time() - start:.0f} s so far)", file=sys.stderr, flush=True)
        print(format_memory(runs) + "\n", flush=True)
        print(format_compute(runs, predictor.config.grad_accumulation_steps, predictor.limit_mib) + "\n", flush=True)
        results.extend(runs)
    print(f"commands (all from the repository root, OMP_NUM_THREADS=1, {NUM_STAGES} ranks each):", flush=True)
    for run in results:
        print(f"  {run.command}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"total wall time {time.time() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
