"""`megatron_ds.testing.script_runs.run_python` answers as `subprocess.run([sys.executable, ...])` does: the exit
status, stdout and stderr apart, argv, working directory and environment of the run, a traceback and status 1 for
an uncaught exception, `TimeoutExpired` past the timeout; and the next run after a timeout is answered correctly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ds.testing.script_runs import run_python

CODE = """
import os, sys
print("out", sys.argv[1:], os.getcwd(), os.environ.get("SCRIPT_RUNS_PROBE"))
print("err", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_status_streams_argv_cwd_and_env_are_the_runs(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(CODE)
    env = {"PATH": "/usr/bin:/bin", "SCRIPT_RUNS_PROBE": "seen"}
    for code in ("0", "3"):
        mine = run_python([str(script), code], timeout=60, cwd=tmp_path, env=env)
        theirs = subprocess.run(
            [sys.executable, str(script), code], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env
        )
        assert (mine.returncode, mine.stdout, mine.stderr) == (theirs.returncode, theirs.stdout, theirs.stderr)
        assert mine.stdout == f"out ['{code}'] {tmp_path} seen\n" and mine.returncode == int(code)


def test_an_uncaught_exception_is_a_traceback_and_status_1() -> None:
    out = run_python(["-c", "raise ValueError('no such value')"], timeout=60)
    assert out.returncode == 1 and out.stderr.rstrip().endswith("ValueError: no such value"), out.stderr
    assert "Traceback (most recent call last)" in out.stderr


def test_a_run_past_its_timeout_is_killed_and_the_next_run_answers() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; print('started', flush=True); time.sleep(600)"], timeout=2)
    out = run_python(["-c", "print('next')"], timeout=60)
    assert (out.returncode, out.stdout) == (0, "next\n")
