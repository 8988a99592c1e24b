"""Every multi-rank process ends by destroying its process groups (`shutdown_distributed`) and
leaves without finalising the interpreter (`exit_process`).

Without them, a gloo worker thread can release a finished broadcast while the interpreter
finalises and abort the rank with SIGABRT; `benchmarks/exit_abort_repro.py` shows the abort in
about half of such launches and none with the teardown. The groups DeepSpeed's engine (here: the
script) still holds keep their threads through the teardown, so after an error, with no closing
barrier, a 2-stage run's stop still aborted in a few launches in a hundred until ranks stopped
finalising the interpreter.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

from megatron_ds.testing.launch import run_ranks

WORKER = textwrap.dedent(r'''
    import atexit, sys, threading, time, torch, torch.distributed as dist
    from megatron_ds.distributed import exit_process, shutdown_distributed
    mode = sys.argv[1]
    atexit.register(print, "atexit ran", flush=True)
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread joined", flush=True))).start()

    class Finalised:
        def __del__(self):  # runs only if the interpreter finalises
            print("finalised", flush=True)

    finalised = Finalised()
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
    exit_process(0 if mode == "clean" else 2)  # an error's status: pretrain_gpt.py's one-line errors leave with 2
''')


def _script(tmp_path: Path) -> str:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return str(path)


def test_clean_and_error_teardown_exit_with_their_status_on_every_rank_unfinalised(tmp_path: Path) -> None:
    """Exactly 0 after a clean teardown, exactly 2 after an error's (a rank aborted at finalisation shows -6 or
    -11); the exit joins threads and runs atexit handlers as the interpreter would, but finalises nothing."""
    script = _script(tmp_path)
    for mode, status in (("clean", 0), ("clean", 0), ("error", 2)):  # without the teardown about half abort
        results = run_ranks([script, mode], 5, timeout=120, cwd=str(Path(__file__).parents[2]), check=False)
        assert [r.returncode for r in results] == [status] * 5, [r.output[-2000:] for r in results]
        for r in results:
            assert f"rank {r.rank} torn down" in r.output and "thread joined" in r.output, r.output[-2000:]
            assert "atexit ran" in r.output and "finalised" not in r.output, r.output[-2000:]


def test_a_stuck_teardown_exits_with_its_own_status_instead_of_hanging(tmp_path: Path) -> None:
    from megatron_ds.distributed import TEARDOWN_STUCK_EXIT_CODE

    results = run_ranks([_script(tmp_path), "stuck"], 2, timeout=60, cwd=str(Path(__file__).parents[2]),
                        check=False)
    for r in results:
        assert r.returncode == TEARDOWN_STUCK_EXIT_CODE, r.output[-2000:]
        assert f"[teardown] rank {r.rank}: destroying the process groups did not finish within 1s" in r.output
        assert "not reached" not in r.output

