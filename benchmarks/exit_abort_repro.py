#!/usr/bin/env python
"""The abort at exit, reproduced in isolation, with and without our teardown.

Each launch starts 5 gloo ranks that do what DeepSpeed's pipeline engine does on CPU: one
all-gather, then a broadcast in each stage-pair subgroup (its point-to-point send). Without a
teardown the process then exits; a gloo worker thread may still hold the finished broadcast
and release its tensor while the interpreter finalises, which aborts the rank (SIGABRT,
"terminate called without an active exception"; backtrace: ProcessGroupGloo::runLoop ->
~AsyncBroadcastWork -> TensorImpl::decref_pyobject -> take_gil -> pthread_exit -> std::terminate).
With `megatron_ds.distributed.shutdown_distributed` (a closing barrier, then every group destroyed)
the workers are done first; the groups the script still holds (`pairs`, as DeepSpeed's engine holds
its own) keep their threads to the end, which is why scripts also leave through `exit_process`.

    python benchmarks/exit_abort_repro.py --launches 20     # ~4 minutes on 2 cores

Prints one row per variant: launches, launches with a non-zero rank, exit statuses seen.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_ds.testing.launch import run_ranks  # noqa: E402

WORKER = r"""
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
gathered = [torch.empty(1) for _ in range(world)]
dist.all_gather(gathered, torch.tensor([float(rank)]))
pairs = [dist.new_group([i, i + 1]) for i in range(world - 1)]  # every rank creates every group
for i, group in enumerate(pairs):
    if rank in (i, i + 1):
        dist.broadcast(torch.ones(4), i, group=group)
if sys.argv[1] == "teardown":
    from megatron_ds.distributed import shutdown_distributed
    shutdown_distributed()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=20, help="launches per variant")
    ap.add_argument("--ranks", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "worker.py")
        script.write_text(WORKER)
        print(f"{'variant':<12} {'launches':>8} {'failed':>7}  exit statuses seen (per rank)")
        for variant in ("no-teardown", "teardown"):
            codes: Counter = Counter()
            failed = 0
            for _ in range(args.launches):
                results = run_ranks([str(script), variant], args.ranks, timeout=120, cwd=str(ROOT), check=False)
                codes.update(r.returncode for r in results)
                failed += any(r.returncode != 0 for r in results)
            seen = " ".join(f"{'hang' if c is None else c}x{k}" for c, k in sorted(codes.items(), key=str))
            print(f"{variant:<12} {args.launches:>8} {failed:>7}  {seen}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
