"""How long `python -m megatron_ds.plan pipeline` takes, process start to exit, over many jobs.

Issue 25's target: under 5 s for any model and GPU count up to 4096 GPUs. Each job runs as its own process
(imports included, as a user runs it), one at a time, under a 120 s timeout:
  sweep   every model preset x GPU counts 8 to 4096 on an A100-80GB and an H100-80GB, the preset's batch;
  random  `--random N` jobs drawn with `--seed S`: a preset, a GPU count up to 4096, a GPU of the table
          and the preset's batch or one of 256 to 4096;
  deep    models deeper than any preset, up to the planner's limit (`plan.inputs.MAX_LAYERS`, 512 layers:
          hidden 4096, 32 heads, sequence 4096, batch 4096) on 64, 1024 and 4096 H100s;
  moe     Megatron-DeepSpeed's mixture-of-experts example models (examples_deepspeed/MoE: 350M MoE-128, 1.3B
          PR-MoE 64/128 with its residual MLP, top-2 on a 1.3B MoE-64) on 16 to 4096 H100s, batch 4096;
  kd      knowledge distillation as examples_deepspeed/MoE's kd lines: a 1.3B student of a 6.7B dense teacher
          (--kd), and a 1.3B PR-MoE student of a 1.3B MoE-128 teacher (--mos), on 16 to 4096 H100s, batch 4096.
It prints the slowest jobs, then the count, median and maximum per group. Wall time on a shared machine is
noisy: run it on a quiet one.

    python benchmarks/planner_speed.py [--random 120] [--seed 1] [--no-sweep] [--top 10]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_ds.plan.hardware import PRESETS  # noqa: E402
from megatron_ds.plan.inputs import MAX_LAYERS  # noqa: E402

GPU_COUNTS = (8, 64, 256, 512, 1024, 2048, 4096)
RANDOM_COUNTS = (8, 16, 32, 64, 96, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
RANDOM_GPUS = ("A100-80GB", "A100-40GB", "H100-80GB", "H200", "V100-32GB", "MI300X", "L40S")
BATCHES = (None, 256, 512, 1024, 2048, 4096)
TIMEOUT_S = 120


def run(args: list[str]) -> tuple[float, int]:
    """Seconds from start to exit and the exit status (124 on timeout)."""
    argv = [sys.executable, "-m", "megatron_ds.plan", "pipeline", *args]
    started = time.perf_counter()
    try:
        status = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=TIMEOUT_S).returncode
    except subprocess.TimeoutExpired:
        status = 124
    return time.perf_counter() - started, status


def sweep_jobs() -> list[list[str]]:
    return [
        ["--model", name, "--num-gpus", str(n), "--gpu", gpu]
        for name in PRESETS
        for n in GPU_COUNTS
        for gpu in ("A100-80GB", "H100-80GB")
    ]


def deep_jobs() -> list[list[str]]:
    model = ["--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096", "--vocab-size", "50257"]
    return [
        ["--num-layers", str(layers), *model, "--num-gpus", str(n), "--gpu", "H100-80GB", "--global-batch-size", "4096"]
        for layers in (128, 256, 384, MAX_LAYERS)
        for n in (64, 1024, 4096)
    ]


GPT_1_3B = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16"]
GPT_350M = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16"]
DATA = ["--seq-length", "2048", "--vocab-size", "50257", "--global-batch-size", "4096", "--gpu", "H100-80GB"]
PR_MOE = ["--num-experts", *["64"] * 10, "128", "128", "--mlp-type", "residual", "--expert-interval", "2"]
MOE_COUNTS = (16, 64, 512, 4096)


def moe_jobs() -> list[list[str]]:
    models = (
        [*GPT_350M, "--num-experts", "128", "--expert-interval", "2"],
        [*GPT_1_3B, *PR_MOE],
        [*GPT_1_3B, "--num-experts", "64", "--expert-interval", "2", "--topk", "2"],
    )
    return [[*model, *DATA, "--num-gpus", str(n)] for model in models for n in MOE_COUNTS]


def kd_jobs() -> list[list[str]]:
    teacher_6_7b = ["--num-layers-teacher", "32", "--hidden-size-teacher", "4096"]
    teacher_6_7b += ["--num-attention-heads-teacher", "32"]
    teacher_moe = ["--num-layers-teacher", "24", "--hidden-size-teacher", "2048"]
    teacher_moe += ["--num-attention-heads-teacher", "16", "--num-experts-teacher", "128"]
    runs = (
        [*GPT_1_3B, "--kd", *teacher_6_7b],
        [*GPT_1_3B, *PR_MOE, "--mos", *teacher_moe],
    )
    return [[*run, *DATA, "--num-gpus", str(n)] for run in runs for n in MOE_COUNTS]


def random_jobs(count: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    jobs = []
    for _ in range(count):
        batch = rng.choice(BATCHES)
        job = ["--model", rng.choice(list(PRESETS)), "--num-gpus", str(rng.choice(RANDOM_COUNTS))]
        job += ["--gpu", rng.choice(RANDOM_GPUS)] + (["--global-batch-size", str(batch)] if batch else [])
        jobs.append(job)
    return jobs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random", type=int, default=120, help="random jobs (default 120)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-sweep", action="store_true", help="skip the presets x GPU counts sweep")
    parser.add_argument("--top", type=int, default=10, help="slowest jobs to list")
    args = parser.parse_args()
    groups = {} if args.no_sweep else {"sweep": sweep_jobs()}
    groups[f"random (seed {args.seed})"] = random_jobs(args.random, args.seed)
    groups["deep"] = deep_jobs()
    groups["moe"] = moe_jobs()
    groups["kd"] = kd_jobs()
    results = []
    for group, jobs in groups.items():
        for job in jobs:
            seconds, status = run(job)
            results.append((seconds, status, group, " ".join(job)))
    print(f"{'seconds':>8} {'exit':>4}  {'group':<16} job")
    for seconds, status, group, job in sorted(results, reverse=True)[: args.top]:
        print(f"{seconds:8.2f} {status:4d}  {group:<16} {job}")
    print()
    print(f"{'group':<16} {'jobs':>5} {'median s':>9} {'max s':>7} {'over 5 s':>8} {'failed':>6}")
    for group in groups:
        times = [r[0] for r in results if r[2] == group]
        if not times:  # e.g. --random 0
            continue
        failed = sum(1 for r in results if r[2] == group and r[1] != 0)
        over = sum(1 for t in times if t > 5.0)
        print(f"{group:<16} {len(times):5d} {statistics.median(times):9.2f} {max(times):7.2f} {over:8d} {failed:6d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
