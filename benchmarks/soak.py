#!/usr/bin/env python
"""Soak: launch many short multi-rank runs and report every exit that was not clean.

Each launch is one of the KINDS below (P = 3..5, every dedicated mode, ZeRO 0/1, fp32/bf16, T = 2,
sequence parallelism at T = 2 with P = 2 and dedicated P = 3, DeepSpeed-Ulysses, the ZB-H1 and
interleaved schedules, alone and with sequence parallelism, the test scenario runner), taken in
turn, on local CPU ranks (gloo) under a hard timeout. The
table gives each launch's exit statuses, duration and, for a failure, the first error line; the
logs of every failed launch are kept under OUT/failed/<n>-<kind>/ (with core files when
`--core-dumps` is given). Nothing is retried and no exit status is rewritten.

    python benchmarks/soak.py --launches 500 --out soak_out      # ~3 hours on 2 cores
    python benchmarks/soak.py --launches 10 --kinds p5-both-z1    # one kind only

Exit status: 0 when every launch exited 0 on every rank, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_ds.testing.launch import run_ranks  # noqa: E402

TINY = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--vocab-size",
    "128",
    "--mock-data",
    "--train-iters",
    "3",
    "--log-interval",
    "1",
    "--eval-iters",
    "1",
    "--eval-interval",
    "2",
    "--lr",
    "1e-3",
    "--num-workers",
    "0",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "4",
    "--distributed-timeout-minutes",
    "10",  # a slow step on a loaded machine is not a hang; a real hang still ends at the launch timeout
]


def _pretrain(world: int, *flags: str) -> tuple[int, list[str]]:
    return world, [str(ROOT / "pretrain_gpt.py"), *TINY, *flags]


KINDS: dict[str, tuple[int, list[str]]] = {
    "p3-pre-z1-bf16": _pretrain(
        3,
        "--pipeline-model-parallel-size",
        "3",
        "--pp-dedicated-embedding-stages",
        "pre",
        "--zero-stage",
        "1",
        "--bf16",
    ),
    "p4-post-z0": _pretrain(4, "--pipeline-model-parallel-size", "4", "--pp-dedicated-embedding-stages", "post"),
    "p5-both-z1": _pretrain(
        5,
        "--pipeline-model-parallel-size",
        "5",
        "--num-layers",
        "3",
        "--pp-dedicated-embedding-stages",
        "both",
        "--zero-stage",
        "1",
    ),
    "p4-stock-z0-bf16": _pretrain(4, "--pipeline-model-parallel-size", "4", "--bf16"),
    "p2-t2-z0": _pretrain(4, "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"),
    "p2-t2-sp-z1-sel": _pretrain(
        4,
        "--pipeline-model-parallel-size",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--zero-stage",
        "1",
        "--recompute-activations",
    ),
    "p3-t2-sp-both": _pretrain(
        6,
        "--pipeline-model-parallel-size",
        "3",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--pp-dedicated-embedding-stages",
        "both",
        "--checkpoint-activations",
    ),
    "ulysses2-dp2-z3": _pretrain(
        4, "--ds-sequence-parallel-size", "2", "--zero-stage", "3", "--no-pipeline-parallel", "--bf16"
    ),
    "p3-zbh1-both-z1": _pretrain(
        3,
        "--pipeline-model-parallel-size",
        "3",
        "--enable-zbh1-pipeline",
        "--enable-zbh1-exact-semantics",
        "--pp-dedicated-embedding-stages",
        "both",
        "--zero-stage",
        "1",
    ),
    "p2-interleaved-v2-pre-bf16": _pretrain(
        2,
        "--pipeline-model-parallel-size",
        "2",
        "--num-virtual-stages-per-pipeline-rank",
        "2",
        "--pp-dedicated-embedding-stages",
        "pre",
        "--bf16",
    ),
    "p2-t2-sp-zbh1": _pretrain(
        4,
        "--pipeline-model-parallel-size",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--enable-zbh1-pipeline",
        "--enable-zbh1-exact-semantics",
    ),
    "p2-t2-sp-interleaved-v2": _pretrain(
        4,
        "--pipeline-model-parallel-size",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--num-virtual-stages-per-pipeline-rank",
        "2",
    ),
    "p3-memory-save": _pretrain(
        3,
        "--pipeline-model-parallel-size",
        "3",
        "--pp-partition-method",
        "memory",
        "--save",
        "{run_dir}/ckpt",
        "--save-interval",
        "2",
    ),
    "scenario-p5": (5, ["-m", "megatron_ds.testing.scenario", "{run_dir}/spec.json", "{run_dir}"]),
}
# What the scenario runner trains in the "scenario-p5" kind: the test that once aborted at exit
# (P=5, every dedicated mode, ZeRO 0 and 1, several engines in one process).
SCENARIO_SPEC = {
    "scenarios": [
        {
            "overrides": {
                "parallel__pipeline_model_parallel_size": 5,
                "model__num_layers": 3,
                "training__zero_stage": z,
            },
            "layout": {"dedicated": "both"},
            "steps": 2,
        }
        for z in (0, 1)
    ]
}

ERROR_LINE = re.compile(r"terminate called|Traceback|Error|error:|exited|watchdog|Abort|Killed", re.IGNORECASE)


def first_error_line(outputs: list[str]) -> str:
    for out in outputs:
        for line in out.splitlines():
            if ERROR_LINE.search(line) and "Warning" not in line:
                return line.strip()[:110]
    return "(no error line)"


def launch(n: int, kind: str, out_dir: Path, timeout: float) -> dict:
    world, argv = KINDS[kind]
    run_dir = Path(tempfile.mkdtemp(prefix=f"soak{n}-", dir=out_dir))
    if kind.startswith("scenario"):
        (run_dir / "spec.json").write_text(json.dumps(SCENARIO_SPEC))
    argv = [a.replace("{run_dir}", str(run_dir)) for a in argv]
    start = time.monotonic()
    results = run_ranks(argv, world, timeout=timeout, cwd=str(run_dir), env={"DS_ACCELERATOR": "cpu"}, check=False)
    seconds = time.monotonic() - start
    codes = [r.returncode for r in results]
    ok = all(c == 0 for c in codes)
    row = {
        "n": n,
        "kind": kind,
        "codes": codes,
        "seconds": round(seconds, 1),
        "ok": ok,
        "error": "" if ok else first_error_line([r.output for r in results if r.returncode != 0]),
    }
    if ok:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        kept = out_dir / "failed" / f"{n:04d}-{kind}"
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(run_dir), kept)
        for r in results:
            (kept / f"rank{r.rank}.log").write_text(r.output)
        row["logs"] = str(kept)
    return row


def _codes(codes: list) -> str:
    return ",".join("hang" if c is None else str(c) for c in codes)


def print_summary(rows: list[dict]) -> None:
    print("\nkind               launches  failed  mean s  exit statuses seen")
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        seen = Counter(c for r in mine for c in r["codes"])
        statuses = " ".join(f"{'hang' if c is None else c}x{k}" for c, k in sorted(seen.items(), key=str))
        print(
            f"{kind:<18} {len(mine):>8} {sum(not r['ok'] for r in mine):>7} "
            f"{sum(r['seconds'] for r in mine) / len(mine):>7.1f}  {statuses}"
        )
    failed = [r for r in rows if not r["ok"]]
    print(f"total: {len(rows)} launches, {len(failed)} failed")
    for r in failed:
        print(f"  #{r['n']} {r['kind']}: exit {_codes(r['codes'])}: {r['error']} (logs: {r['logs']})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=len(KINDS), help="total launches (kinds taken in turn)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of: {', '.join(KINDS)}")
    ap.add_argument("--out", default="soak_out", help="where failed launches' logs are kept")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per launch before it counts as a hang")
    ap.add_argument("--core-dumps", action="store_true", help="let ranks write core files (kept with the logs)")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"error: --kinds {','.join(unknown)}: unknown; choose from {', '.join(KINDS)}", file=sys.stderr)
        return 2
    if args.core_dumps:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{'#':>5}  {'kind':<18} {'exit statuses':<14} {'seconds':>7}  first error line", flush=True)
    rows = []
    for n in range(1, args.launches + 1):
        row = launch(n, kinds[(n - 1) % len(kinds)], out, args.timeout)
        rows.append(row)
        print(
            f"{n:>5}  {row['kind']:<18} {_codes(row['codes']):<14} {row['seconds']:>7.1f}  {row['error']}", flush=True
        )
    print_summary(rows)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
