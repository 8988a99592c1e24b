"""Pipeline schedules side by side: 1F1B (DeepSpeed's), ZB-H1 and interleaved 1F1B on this machine.

    python benchmarks/schedules.py target   # the 48-layer model at P = 5, M = 4 (~4 min on 2 cores)
    python benchmarks/schedules.py step     # P = 2, M = 4 and 8, one core per rank (~6 min on 2 cores)

`target`: the issue's 48-layer model (benchmarks/stage_memory.py's) on 5 CPU ranks, fp32, M = 4,
where 1F1B idles as long as it computes. For each schedule, its fastest layout within the memory
limit L of the stock split's largest stage (1F1B and ZB-H1: `--pp-partition-method fastest`;
interleaved: v = 2 with dedicated embedding and head stages): the simulated step from the compute
model's FLOPs (`estimate/step_simulator.py` over the schedule's own instruction streams) and from
the run's measured per-stage compute (the stage timers' line), each against the best 1F1B layout's;
and, per rank, the measured peak memory (`training/measure/memory.py`) against the memory model.

`step`: a model whose step is long next to the point-to-point latency, on 2 ranks (a core each):
the wall-clock step (median of the timed iterations) of each schedule, with the simulator's step
from the same run's measured compute beside it.

Every run is `pretrain_gpt.py` under torchrun (the commands are printed); results and the exact
commands go to benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1024.0 * 1024.0
TARGET_MODEL = (
    "--num-layers 48 --hidden-size 384 --num-attention-heads 8 --seq-length 128 --vocab-size 32000 "
    "--micro-batch-size 1 --global-batch-size 4".split()
)
STEP_MODEL = "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 256 --vocab-size 8192".split()
COMMON = (
    "--mock-data --eval-iters 0 --lr 1e-4 --num-workers 0 --hidden-dropout 0 --attention-dropout 0 --seed 1234 "
    "--distributed-timeout-minutes 10"
).split()
MEMORY = re.compile(
    r"\[Rank (\d+) \| stage (\d+)\] \(after \d+ iterations\) memory \(MB\) \|.*total \(measured peak\): ([\d.]+)"
)
SIMULATED = re.compile(r"step from these compute times with one device per stage \(schedule simulator\): ([\d.]+) ms")
WALL = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")
LAYOUT = re.compile(r"transformer layers per stage: [\d ]+ \(layout (\S+), method")


def run(argv: list[str], ranks: int) -> str:
    from megatron_ds.testing.launch import run_torchrun

    print("  torchrun --nproc_per_node", ranks, "pretrain_gpt.py", shlex.join(argv), file=sys.stderr, flush=True)
    out = run_torchrun(ranks, [str(ROOT / "pretrain_gpt.py"), *argv], timeout=1800, cwd=str(ROOT))
    if out.returncode != 0:
        raise RuntimeError(f"pretrain_gpt.py exited {out.returncode}:\n{out.stdout[-4000:]}")
    return out.stdout


def predicted(argv: list[str], ranks: int) -> tuple[str, float, list[float]]:
    """(layout, the compute model's simulated step in GFLOP, predicted memory per rank in MiB)."""
    from megatron_ds.estimate.layout_costs import flop_stage_time
    from megatron_ds.estimate.machine import CPU
    from megatron_ds.estimate.memory_model import stage_memory
    from megatron_ds.estimate.run_layout import build_run_layout, memory_inputs
    from megatron_ds.estimate.step_simulator import simulate
    from megatron_ds.flags.parser import parse_config

    config, _ = parse_config([*argv, "--print-layout"], world_size=ranks)
    layout, mem = build_run_layout(config, CPU), memory_inputs(config, CPU)
    times = [flop_stage_time(mem, layout.num_stages)(s, k) for s, k in enumerate(layout.layers_per_stage)]
    step = simulate(
        mem.num_micro_batches,
        [t.forward for t in times],
        [t.backward for t in times],
        schedule=mem.schedule,
        weight=[t.weight for t in times],
        virtual_stages=mem.virtual_stages,
    ).step_time
    return layout.to_string(), step, [st.total / MIB for st in stage_memory(mem, layout)]


def target() -> None:
    from megatron_ds.estimate.machine import CPU
    from megatron_ds.estimate.memory_model import stage_memory
    from megatron_ds.estimate.run_layout import build_run_layout, memory_inputs
    from megatron_ds.flags.parser import parse_config

    p, iters = 5, 10
    base = [*TARGET_MODEL, *COMMON, "--pipeline-model-parallel-size", str(p), "--train-iters", str(iters)]
    base += ["--log-interval", "8"]
    config, _ = parse_config([*base, "--print-layout"], world_size=p)
    limit = max(st.total for st in stage_memory(memory_inputs(config, CPU), build_run_layout(config, CPU))) / MIB
    fastest = ["--pp-partition-method", "fastest", "--pp-memory-limit", f"{math.ceil(10 * limit) / 10:.1f}MiB"]
    schedules = {
        "1f1b": fastest,
        "zbh1": [*fastest, "--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"],
        "interleaved": ["--num-virtual-stages-per-pipeline-rank", "2", "--pp-dedicated-embedding-stages", "both"],
    }
    rows = {}
    for name, flags in schedules.items():
        argv = [*base, *flags]
        layout, flops, memory = predicted(argv, p)
        text = run(argv, p)
        measured = {int(m.group(1)): float(m.group(3)) for m in MEMORY.finditer(text)}
        simulated = float(SIMULATED.search(text).group(1))
        rows[name] = (layout, flops, simulated, [measured[r] for r in range(p)], memory, argv)
    print(
        f"48-layer model, P = {p}, M = 4, fp32, ZeRO-0; memory limit {limit:.1f} MiB (the stock split's largest stage)"
    )
    print(f"{'schedule':<12} {'layout':<42} {'sim (GFLOP)':>11} {'x 1F1B':>7} {'sim (meas.)':>11} {'x 1F1B':>7}")
    for name, (layout, flops, simulated, _, _, _) in rows.items():
        print(
            f"{name:<12} {layout:<42} {flops:>11.2f} {flops / rows['1f1b'][1]:>7.3f} {simulated:>9.0f}ms "
            f"{simulated / rows['1f1b'][2]:>7.3f}"
        )
    print("memory per rank (MiB): measured / predicted (memory model)")
    for name, (_, _, _, measured, memory, _) in rows.items():
        cells = " ".join(f"{a:7.1f}/{b:7.1f} ({a / b:.3f})" for a, b in zip(measured, memory))
        print(
            f"{name:<12} {cells}; largest {max(measured):.1f} MiB, worst {max(abs(a / b - 1) for a, b in zip(measured, memory)):.1%}"
        )
    for name, (*_, argv) in rows.items():
        print(f"  {name}: torchrun --nproc_per_node {p} pretrain_gpt.py {shlex.join(argv)}")


def step() -> None:
    p, iters = 2, 12
    print(f"P = {p}, 2 ranks with a core each; wall-clock step = median of iterations 4..{iters} (ms)")
    print(f"{'M':>3} {'schedule':<16} {'wall step':>10} {'x 1F1B':>7} {'simulated':>10} {'x 1F1B':>7}")
    commands = []
    for m in (4, 8):
        base = [*STEP_MODEL, *COMMON, "--pipeline-model-parallel-size", str(p), "--train-iters", str(iters)]
        base += ["--micro-batch-size", "1", "--global-batch-size", str(m), "--log-interval", "1", "--no-log-memory"]
        found = {}
        for name, flags in (
            ("1f1b", []),
            ("zbh1", ["--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"]),
            ("interleaved v=2", ["--num-virtual-stages-per-pipeline-rank", "2"]),
        ):
            text = run([*base, *flags], p)
            walls = [float(ms) for it, ms in WALL.findall(text) if int(it) >= 4]
            found[name] = (statistics.median(walls), float(SIMULATED.search(text).group(1)))
            commands.append(f"torchrun --nproc_per_node {p} pretrain_gpt.py {shlex.join([*base, *flags])}")
        for name, (wall, sim) in found.items():
            ref_wall, ref_sim = found["1f1b"]
            print(f"{m:>3} {name:<16} {wall:>10.0f} {wall / ref_wall:>7.3f} {sim:>10.0f} {sim / ref_sim:>7.3f}")
    for c in commands:
        print(f"  {c}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("target", "step"))
    args = parser.parse_args(argv)
    start = time.time()
    {"target": target, "step": step}[args.what]()
    print(f"total wall time {time.time() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
