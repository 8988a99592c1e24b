#!/usr/bin/env python
"""How long `--load-teacher` takes to build its teacher, and the most memory a rank holds meanwhile, on 2 CPU ranks.

Two teachers, each saved once (a 0-step run of the teacher's own model, `megatron_ds.testing.scenario`) and then loaded
by a 2-layer student (`build_pipeline` with --kd: `training/distillation.load_teacher`, which this script times):

    tp   GPT of 24 layers, hidden 2048, 16 heads, MLP 8192, vocabulary 32768 (1.3B), tensor-parallel over the 2
         ranks (T = 2): each rank holds half of it
    moe  GPT of 12 layers, hidden 2048, 16 heads, MLP 8192, 2 experts in every second layer, vocabulary 32768
         (0.9B), its experts over the 2 ranks (--moe-expert-parallel-size 2): each rank one expert per MoE layer

Per rank: wall and CPU seconds of `load_teacher`, the resident memory before and after it, and the peak during it
(VmHWM, reset before the call through /proc/self/clear_refs), in MiB. fp32; the student is tiny.

    OMP_NUM_THREADS=1 python benchmarks/teacher_load.py --dir /tmp/teachers             # both (saves on the first run)
    OMP_NUM_THREADS=1 python benchmarks/teacher_load.py --dir /tmp/teachers --teachers tp
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORLD = 2
SHARED = {
    "model__vocab_size": 32768,
    "training__micro_batch_size": 1,
    "training__global_batch_size": 2,
    "parallel__world_size": WORLD,
}
BIG = {"model__hidden_size": 2048, "model__num_attention_heads": 16, "model__ffn_hidden_size": 8192}
TEACHERS = {
    "tp": {**SHARED, **BIG, "model__num_layers": 24, "parallel__tensor_model_parallel_size": 2},
    "moe": {
        **SHARED,
        **BIG,
        "model__num_layers": 12,
        "model__num_experts": [2],
        "model__moe_token_dropping": False,
        "parallel__expert_parallel_size": 2,
    },
}
STUDENT = {"model__num_layers": 2, "model__hidden_size": 64, "model__num_attention_heads": 4}


def student(kind: str, teacher_dir: str) -> dict[str, Any]:
    """The 2-layer student's overrides: the teacher's parallel sizes and routing, --kd from `teacher_dir`."""
    teacher = TEACHERS[kind]
    keep = ("parallel__", "model__vocab_size", "model__moe_token_dropping", "training__")
    return {
        **{k: v for k, v in teacher.items() if k.startswith(keep)},
        **STUDENT,
        "model__ffn_hidden_size": 256,
        "distillation__kd": True,
        "distillation__load_teacher": teacher_dir,
    }


def _status(field: str) -> float:
    """A /proc/self/status memory field in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def rank_main(overrides_json: str, out_dir: str) -> None:
    """One rank: build the student (and its teacher), timing `load_teacher`."""
    from megatron_ds.distributed import env_world_size, init_distributed, shutdown_distributed
    from megatron_ds.testing.scenario import tiny_config
    from megatron_ds.training import distillation
    from megatron_ds.training.builder import build_pipeline
    from megatron_ds.training.resolve_layout import resolve_layout

    config = tiny_config(**json.loads(overrides_json)).replace(parallel__world_size=env_world_size())
    init_distributed(config.parallel)
    load = distillation.load_teacher
    record: dict[str, float] = {}

    def timed(*args: Any, **kwargs: Any) -> Any:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) starts again from now
        record["rss_before_mib"] = _status("VmRSS")
        wall, cpu = time.perf_counter(), time.process_time()
        teacher = load(*args, **kwargs)
        record.update(seconds=time.perf_counter() - wall, cpu_seconds=time.process_time() - cpu)
        record.update(peak_mib=_status("VmHWM"), rss_after_mib=_status("VmRSS"))
        return teacher

    distillation.load_teacher = timed
    try:
        build_pipeline(config, layout=resolve_layout(config))
    finally:
        shutdown_distributed(clean=True)
    Path(out_dir, f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))


def save_teacher(kind: str, path: Path) -> None:
    from megatron_ds.testing.scenario_runs import run_scenarios

    scenario = {"overrides": TEACHERS[kind], "steps": 0, "save": str(path)}
    run_scenarios(path.parent / "save", WORLD, [scenario], timeout=1800)


def measure(kind: str, root: Path) -> list[dict[str, float]]:
    from megatron_ds.testing.launch import run_ranks

    teacher = root / kind / "teacher"
    if not (teacher / "latest").is_file():
        print(f"saving the {kind} teacher to {teacher} ...", flush=True)
        save_teacher(kind, teacher)
    out = root / kind / "load"
    out.mkdir(parents=True, exist_ok=True)
    overrides = json.dumps(student(kind, str(teacher)))
    run_ranks([__file__, "--rank", overrides, str(out)], WORLD, timeout=1800)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="where the teachers are saved (kept for later runs)")
    parser.add_argument("--teachers", nargs="+", choices=sorted(TEACHERS), default=sorted(TEACHERS, reverse=True))
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--rank", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = {kind: measure(kind, Path(args.dir)) for kind in args.teachers}
    print(
        f"{'teacher':8} {'rank':>4} {'wall s':>8} {'cpu s':>8} {'RSS before':>11} {'peak':>8} {'RSS after':>10}  (MiB)"
    )
    for kind, ranks in rows.items():
        for r, x in enumerate(ranks):
            print(
                f"{kind:8} {r:>4} {x['seconds']:8.1f} {x['cpu_seconds']:8.1f} {x['rss_before_mib']:11.0f} "
                f"{x['peak_mib']:8.0f} {x['rss_after_mib']:10.0f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    if "--rank" in sys.argv:
        i = sys.argv.index("--rank")
        rank_main(sys.argv[i + 1], sys.argv[i + 2])
    else:
        main()
