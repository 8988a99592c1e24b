"""Run `python SCRIPT.py ARGS...` (or `-m MODULE`, `-c CODE`) from a test as `subprocess.run` would, without paying
torch's and DeepSpeed's imports each time: one server process per test process imports them once, and forks a
child per run.

    out = run_python([str(ROOT / "pretrain_gpt.py"), *argv], timeout=180, cwd=ROOT)  # a CompletedProcess

The child is what `megatron_ds.testing.zygote` makes a rank: a fresh process image of a process that only
imported (no thread pool, process group or random stream started), in a session of its own, with the run's
working directory, environment, argv, stdout and stderr, running the script as `__main__` and leaving with its
exit status (a traceback and status 1 for an uncaught exception, as the interpreter would). What it cannot be is a
fresh interpreter: the preloaded modules are already imported, so a test of what a script imports, of an
environment variable read at import time, or of interpreter finalisation keeps `subprocess.run`. Test-only.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from megatron_ds.testing import zygote

ROOT = Path(__file__).resolve().parents[2]
PRELOAD = ("torch", "torch._dynamo", "deepspeed", "megatron_ds.distributed", "megatron_ds.flags.parser")
"""What the scripts the tests run all import first (about 3 s of CPU per fresh interpreter)."""
START_S = 300.0
"""How long a run may wait for the server to fork it (its imports, on a loaded machine)."""

_server: subprocess.Popen | None = None
_unread = b""  # what the server has answered and no run has read yet
_one_at_a_time = threading.Lock()  # the server answers one run at a time, in order
_SERVER_LOG = os.path.join(tempfile.gettempdir(), f"megatron_ds_script_server_{os.getpid()}.log")


def run_python(
    argv: Sequence[str], timeout: float, cwd: str | Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)`
    in a child forked from the server. `env`: the child's whole environment (default: this process's). Past
    `timeout` the child dumps its stack (SIGUSR1, as a rank does) and is killed, and `subprocess.TimeoutExpired`
    is raised as `subprocess.run` raises it."""
    with _one_at_a_time, tempfile.TemporaryDirectory() as tmp:
        paths = {"stdout": os.path.join(tmp, "stdout"), "stderr": os.path.join(tmp, "stderr")}
        request = {"argv": list(map(str, argv)), "cwd": str(cwd or os.getcwd()), "env": dict(env or os.environ)}
        code = _exchange({**request, **paths}, timeout)
        out, err = (Path(paths[k]).read_text(errors="replace") for k in ("stdout", "stderr"))
    if code is None:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, out, err)
    return subprocess.CompletedProcess([sys.executable, *argv], code, out, err)


def _exchange(request: dict, timeout: float) -> int | None:
    """Send one run, wait for its status (None: killed at `timeout`). Anything unexpected (the server's imports
    outlasting `START_S`, a test interrupted mid-run) ends the server and the run, so that no later run reads an
    earlier one's answers: the next run starts another server."""
    server, pid = _started(), None
    try:
        server.stdin.write(json.dumps(request).encode() + b"\n")
        try:  # the first run waits for the server's imports
            pid = int(_reply(server, time.monotonic() + START_S))
        except TimeoutError:
            raise RuntimeError(f"the script server did not start a run within {START_S:.0f} s") from None
        try:
            return int(_reply(server, time.monotonic() + timeout))
        except TimeoutError:
            _stop(server, pid)
            return None
    except BaseException:
        if pid is not None:
            _kill_group(pid, signal.SIGKILL)
        server.kill()
        server.wait()
        raise


def _started() -> subprocess.Popen:
    """The server, started at the first run (again if it died)."""
    global _server, _unread
    if _server is None or _server.poll() is not None:
        _unread = b""
        _server = subprocess.Popen(
            [sys.executable, "-m", __name__, ",".join(PRELOAD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(_SERVER_LOG, "w"),  # noqa: SIM115 - the server's own output (an import error), kept by it
            bufsize=0,
            cwd=str(ROOT),
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        )
        atexit.register(_server.stdin.close)  # the server leaves at end of input
    return _server


def _reply(server: subprocess.Popen, deadline: float) -> str:
    """The server's next line, or TimeoutError at `deadline`. Read from the pipe itself, not a buffered reader:
    a buffer could hold the next answer too, which `select` would not see."""
    global _unread
    while b"\n" not in _unread:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        ready, _, _ = select.select([server.stdout], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(server.stdout.fileno(), 4096)
            if not chunk:
                said = Path(_SERVER_LOG).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the script server exited with status {server.wait()}: {said}")
            _unread += chunk
    line, _, _unread = _unread.partition(b"\n")
    return line.decode().strip()


def _stop(server: subprocess.Popen, pid: int) -> None:
    """Ask the child's session to dump its stacks, then kill it; the server reaps it and reports its status."""
    if _kill_group(pid, signal.SIGUSR1):
        time.sleep(3.0)
        _kill_group(pid, signal.SIGKILL)
    _reply(server, time.monotonic() + 30)


def _kill_group(pid: int, sig: int) -> bool:
    """`sig` to the run's session; False when it is already gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


# ----- the server ----------------------------------------------------------------------------------


def _child(request: dict) -> None:
    """In the forked child: become the run `request` describes, run it, leave with its status."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, key in ((1, "stdout"), (2, "stderr")):
        target = os.open(request[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    zygote.leave_as_interpreter(lambda: _run(request["argv"]))


def _run(argv: list[str]) -> None:
    """`python argv...` in this process: `-m MODULE`, `-c CODE` or `SCRIPT.py`, each as `__main__`."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - the test's own code
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def main(preload: str) -> None:
    import importlib

    replies = os.fdopen(os.dup(1), "w")  # the answers to the client; what the imports print goes to the log
    os.dup2(2, 1)
    for name in filter(None, preload.split(",")):
        importlib.import_module(name)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            _child(request)
        print(pid, file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), file=replies, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
