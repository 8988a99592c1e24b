"""`distributed.run_and_exit`: an entry point's status as `sys.exit` would give it, and after process groups no
interpreter finalisation (megatron_ds/distributed.py says why)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

SCRIPT = textwrap.dedent(r"""
    import atexit, sys
    from megatron_ds.distributed import run_and_exit

    class Finalised:
        def __del__(self):  # runs only if the interpreter finalises
            print("finalised", flush=True)

    finalised = Finalised()
    atexit.register(print, "atexit ran", flush=True)
    case, groups = sys.argv[1], sys.argv[2] == "groups"

    def entry(value):
        if groups:
            import torch.distributed as dist
            from megatron_ds.config import ParallelConfig
            from megatron_ds.distributed import init_distributed, shutdown_distributed
            init_distributed(ParallelConfig())
            dist.all_reduce(__import__("torch").ones(2))
            shutdown_distributed()
        print("entry ran", flush=True)
        if case == "int":
            return value
        if case == "none":
            return None
        if case == "message":
            raise SystemExit("bad --flag: use another")
        raise ValueError("a crash")

    run_and_exit(entry, 3)
""")

CASES = [
    ("int", 3, ""),
    ("none", 0, ""),
    ("message", 1, "bad --flag: use another"),
    ("crash", 1, "ValueError: a crash"),
]


@pytest.mark.parametrize("groups", ["none", "groups"])
@pytest.mark.parametrize(("case", "status", "err"), CASES, ids=[c[0] for c in CASES])
def test_status_output_and_finalisation(tmp_path: Path, case: str, status: int, err: str, groups: str) -> None:
    """The status is the returned code, a SystemExit's (its message printed, 1) or 1 after a printed traceback;
    atexit handlers always run; the interpreter is finalised only when the process never had process groups."""
    script = tmp_path / "entry.py"
    script.write_text(SCRIPT)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), case, groups], capture_output=True, text=True, timeout=120, env=env, cwd=str(ROOT)
    )
    assert done.returncode == status, done.stderr[-2000:]
    assert "entry ran" in done.stdout and "atexit ran" in done.stdout, done.stdout
    assert err in done.stderr, done.stderr[-2000:]
    assert ("finalised" in done.stdout) == (groups == "none"), done.stdout
