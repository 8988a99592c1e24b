"""Run `python SCRIPT.py ARGS...` (or `-m MODULE`, `-c CODE`) from a test as `subprocess.run` would, without paying
torch's and DeepSpeed's imports each time: the run is forked from a server that imported them once
(`megatron_ds.testing.fork_server`).

    out = run_python([str(ROOT / "pretrain_gpt.py"), *argv], timeout=180, cwd=ROOT)  # a CompletedProcess

The child is what `megatron_ds.testing.zygote` makes a rank: a fresh process image of a process that only
imported (no thread pool, process group or random stream started), in a session of its own, with the run's
working directory, environment, argv, stdout and stderr, running the script as `__main__` and leaving with its
exit status (a traceback and status 1 for an uncaught exception, as the interpreter would). What it cannot be is a
fresh interpreter: the preloaded modules are already imported, so a test of what a script imports, of
interpreter finalisation or of start-up keeps `subprocess.run`. Test-only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from megatron_ds.testing import fork_server
from megatron_ds.testing.launch import signal_group
from megatron_ds.testing.zygote import RUN_PRELOAD


def run_python(
    argv: Sequence[str], timeout: float, cwd: str | Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)`
    in a child forked from the server. `env`: the child's whole environment (default: this process's). Past
    `timeout` the child dumps its stack (SIGUSR1, as a rank does) and is killed, and `subprocess.TimeoutExpired`
    is raised as `subprocess.run` raises it."""
    cmd = [sys.executable, *map(str, argv)]
    cwd, env = str(cwd or os.getcwd()), dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"stdout": os.path.join(tmp, "stdout"), "stderr": os.path.join(tmp, "stderr")}
        try:
            run = fork_server.fork(RUN_PRELOAD, argv, cwd, env, exit_file=os.path.join(tmp, "exit"), streams=paths)
        except fork_server.ServerFailed:  # a fresh interpreter, which reports what went wrong itself
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
        code = _wait(run, timeout)
        out, err = (Path(paths[k]).read_text(errors="replace") for k in ("stdout", "stderr"))
    if code is None:
        raise subprocess.TimeoutExpired(cmd, timeout, out, err)
    return subprocess.CompletedProcess(cmd, code, out, err)


def _wait(run: fork_server.Forked, timeout: float) -> int | None:
    """The run's status; None if it outlived `timeout` (its stacks dumped, then killed). A test interrupted meanwhile
    kills the run before it goes on."""
    try:
        return run.wait(timeout)
    except subprocess.TimeoutExpired:
        if signal_group(run.pid, signal.SIGUSR1):
            time.sleep(3.0)
            signal_group(run.pid, signal.SIGKILL)
        run.wait(30)
        return None
    except BaseException:
        signal_group(run.pid, signal.SIGKILL)
        raise
