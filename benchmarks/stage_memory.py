#!/usr/bin/env python
"""Measured per-stage memory of a GPT with a large embedding, under three pipeline layouts, on CPU.

For each model and layout this runs `pretrain_gpt.py` on 5 CPU ranks (torchrun, gloo, fp32,
`--mock-data`) for 8 iterations with `--log-interval 2`: the memory report of iteration 2 is the
one `pretrain_gpt.py --log-memory` prints (`megatron_ds/training/memory.py`, the same code; it
traces iterations 1-2), and the step time is the fastest of the log windows 3-4, 5-6, 7-8, which
are not traced (the fastest, because other processes on a shared machine slow some windows).
The prediction is the memory model's (`megatron_ds/estimate/memory_model.py`) for the same flags and
layout.

    python benchmarks/stage_memory.py                  # both models, all three layouts (~12 min on 2 cores)
    python benchmarks/stage_memory.py --models 8-layer --layouts stock,memory

Layouts: `stock` is DeepSpeed's `type:transformer` split (our default), `both` is
`--pp-dedicated-embedding-stages both`, `memory` is `--pp-partition-method memory`.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NUM_STAGES = 5
MIB = 1024.0 * 1024.0

MODELS = {
    # The example size: 8 layers cannot balance a 32k x 512 embedding (see docs/layouts.md).
    "8-layer": [
        "--num-layers",
        "8",
        "--hidden-size",
        "512",
        "--num-attention-heads",
        "8",
        "--seq-length",
        "128",
        "--vocab-size",
        "32000",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
    ],
    # Deep enough for the memory layout to balance the embedding and head stages.
    "48-layer": [
        "--num-layers",
        "48",
        "--hidden-size",
        "384",
        "--num-attention-heads",
        "8",
        "--seq-length",
        "128",
        "--vocab-size",
        "32000",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "4",
    ],
}
LAYOUTS = {
    "stock": [],  # --pp-partition-method type:transformer, DeepSpeed's default split
    "both": ["--pp-dedicated-embedding-stages", "both"],
    "memory": ["--pp-partition-method", "memory"],
}
COMMON = [
    "--pipeline-model-parallel-size",
    str(NUM_STAGES),
    "--mock-data",
    "--train-iters",
    "8",
    "--log-interval",
    "2",
    "--eval-iters",
    "0",
    "--lr",
    "1e-4",
    "--num-workers",
    "0",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--seed",
    "1234",
    "--distributed-timeout-minutes",
    "10",
]

REPORT = re.compile(
    r"\[Rank (\d+) \| stage (\d+)\] \(after \d+ iterations\) memory \(MB\) \| params: ([\d.]+) \| "
    r"grads: ([\d.]+) \| optimizer: ([\d.]+) \| activations \(peak saved\): ([\d.]+) \| "
    r"other \(buffers, transients\): (-?[\d.]+) \| total \(measured peak\): ([\d.]+)"
)
STEP = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")
LAYOUT = re.compile(r"transformer layers per stage: [\d ]+ \(layout (\S+), method")


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
    """All in MiB."""


@dataclass
class LayoutRun:
    model: str
    layout_name: str
    layout: str
    step_ms: float
    rows: list[StageRow]
    command: str

    @property
    def totals(self) -> list[float]:
        return [r.measured for r in self.rows]


def argv_for(model: str, layout: str) -> list[str]:
    return [*MODELS[model], *LAYOUTS[layout], *COMMON]


def predicted(argv: list[str]) -> tuple[str, list[float], list[int]]:
    """(layout string, predicted MiB per stage, layers per stage) from the memory model: no torch.distributed."""
    from megatron_ds.arguments import parse_config
    from megatron_ds.estimate.memory_model import stage_memory
    from megatron_ds.estimate.run_layout import build_run_layout, memory_inputs

    config, _ = parse_config(argv, world_size=NUM_STAGES)
    layout = build_run_layout(config)
    stages = stage_memory(memory_inputs(config), layout)
    return layout.to_string(), [s.total / MIB for s in stages], list(layout.layers_per_stage)


def run_layout(model: str, layout: str, timeout: float) -> LayoutRun:
    from megatron_ds.testing.launch import run_torchrun

    argv = argv_for(model, layout)
    layout_string, pred, layers = predicted(argv)
    out = run_torchrun(NUM_STAGES, [str(ROOT / "pretrain_gpt.py"), *argv], timeout=timeout, cwd=str(ROOT))
    text = out.stdout
    if out.returncode != 0:
        raise RuntimeError(f"{model} / {layout}: pretrain_gpt.py exited {out.returncode}:\n{text[-4000:]}")
    printed = LAYOUT.search(text)
    assert printed and printed.group(1) == layout_string, (printed and printed.group(1), layout_string)
    reports = {int(m.group(2)): m for m in REPORT.finditer(text)}
    if sorted(reports) != list(range(NUM_STAGES)):
        raise RuntimeError(f"{model} / {layout}: memory report lines missing:\n{text[-4000:]}")
    rows = []
    for s in range(NUM_STAGES):
        v = [float(x) for x in reports[s].groups()[2:]]  # the report's "MB" are 2**20 bytes, as Megatron's
        rows.append(StageRow(s, layers[s], *v, predicted=pred[s]))
    untraced = [float(m.group(2)) for m in STEP.finditer(text) if int(m.group(1)) > 2]
    step_ms = min(untraced) if untraced else float("nan")
    command = "torchrun --nproc_per_node 5 pretrain_gpt.py " + " ".join(argv)
    return LayoutRun(model, layout, layout_string, step_ms, rows, command)


def format_model(runs: list[LayoutRun]) -> str:
    """One table per model: every layout's stages, their ratio to the median stage, and the step time."""
    stock = next((r for r in runs if r.layout_name == "stock"), runs[0])
    head = (
        f"{'layout':<8} {'stage':>5} {'layers':>6} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} "
        f"{'other':>8} {'measured':>9} {'predicted':>9} {'pred/meas':>9} {'/median':>7}"
    )
    lines = [f"model {runs[0].model}: {' '.join(MODELS[runs[0].model])} (MiB; 5 CPU ranks, fp32, ZeRO-0)", head]
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
            f"first-or-last/median {ends:.2f}, worst prediction error {errors:.1%}, "
            f"step {run.step_ms:.0f} ms = {run.step_ms / stock.step_ms:.2f}x stock"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {', '.join(LAYOUTS)}")
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per pretrain_gpt.py run")
    args = parser.parse_args(argv)
    models, layouts = args.models.split(","), args.layouts.split(",")
    for name, known in ((models, MODELS), (layouts, LAYOUTS)):
        bad = [n for n in name if n not in known]
        if bad:
            parser.error(f"unknown {bad}; choose from {', '.join(known)}")
    results = []
    start = time.time()
    for model in models:
        runs = []
        for layout in layouts:
            runs.append(run_layout(model, layout, args.timeout))
            print(f"  ran {model} / {layout} ({time.time() - start:.0f} s so far)", file=sys.stderr, flush=True)
        print(format_model(runs) + "\n", flush=True)
        results.extend(runs)
    print("commands (all from the repository root, OMP_NUM_THREADS=1):", flush=True)
    for run in results:
        print(f"  {run.command}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"total wall time {time.time() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
