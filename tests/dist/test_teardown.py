"""Every multi-rank process ends by destroying its process groups (`shutdown_distributed`).

Without it, a gloo worker thread can release a finished broadcast while the interpreter
finalises and abort the rank with SIGABRT; `benchmarks/exit_abort_repro.py` shows the abort in
about half of such launches and none with the teardown.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

from megatron_ds.testing.launch import run_ranks

WORKER = textwrap.dedent(r'''
    import sys, torch, torch.distributed as dist
    from megatron_ds.distributed import shutdown_distributed
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([i, i + 1]) for i in range(world - 1)]
    for i, group in enumerate(pairs):
        if rank in (i, i + 1):
            dist.broadcast(torch.ones(4), i, group=group)
    if mode == "stuck":
        import time
        dist.destroy_process_group = lambda *a, **k: time.sleep(60)
        shutdown_distributed(clean=False, timeout_s=1.0)
        print("not reached")
    shutdown_distributed(clean=(mode == "clean"))
    assert not dist.is_initialized()
    shutdown_distributed()  # a second call is a no-op
    print(f"rank {rank} torn down", flush=True)
''')


def _script(tmp_path: Path) -> str:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return str(path)


def test_clean_and_error_teardown_exit_zero_on_every_rank(tmp_path: Path) -> None:
    script = _script(tmp_path)
    for mode in ("clean", "clean", "error"):  # without the teardown about half of such launches abort
        results = run_ranks([script, mode], 5, timeout=120, cwd=str(Path(__file__).parents[2]))
        assert [r.returncode for r in results] == [0] * 5
        assert all(f"rank {r.rank} torn down" in r.output for r in results)


def test_a_stuck_teardown_exits_with_its_own_status_instead_of_hanging(tmp_path: Path) -> None:
    from megatron_ds.distributed import TEARDOWN_STUCK_EXIT_CODE

    results = run_ranks([_script(tmp_path), "stuck"], 2, timeout=60, cwd=str(Path(__file__).parents[2]),
                        check=False)
    for r in results:
        assert r.returncode == TEARDOWN_STUCK_EXIT_CODE, r.output[-2000:]
        assert f"[teardown] rank {r.rank}: destroying the process groups did not finish within 1s" in r.output
        assert "not reached" not in r.output

