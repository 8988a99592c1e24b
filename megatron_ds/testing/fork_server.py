"""Fork each test run (a script, or a multi-rank run's zygote) from a server that imported the heavy libraries once.

    run = fork(preload, ["SCRIPT.py", *args], cwd, env, streams={"stdout": path, "stderr": path})
    run = fork(preload, ["-m", "MODULE", *args], cwd, env, ranks=Zygote(world, status_file, log_template))
    run.wait(timeout)  # a Popen-like handle: pid (its own session), poll, wait, returncode

A test process keeps one server per `preload` (modules; `module:function` also calls the function) and per
environment (less the variables a run sets for itself: RANK, MASTER_PORT, ...): the server is started with that
environment, imports `preload` once, then forks a child per request. A script's child becomes the run as
`megatron_ds.testing.script_runs` describes; a multi-rank run's child is the zygote of
`megatron_ds.testing.zygote`, forking the ranks. Each fresh zygote paid 4-9 s of CPU for its imports (torch,
DeepSpeed, torch's compiler stack, megatron-core); a file of multi-rank tests now pays it once.

The child is a fresh process image of a process that only imported (no thread pool, process group or random
stream started), in a session of its own, with the run's working directory, environment and argv. The server
answers each request with the child's pid, reaps its children as they end and writes each one's exit status to
the file the request named (-N: killed by signal N). It leaves at the end of its input, after its last child.
Anything the client did not expect (the server failing its imports, or not answering in time) is `ServerFailed`:
the caller falls back to a fresh interpreter, which reports the same error as a run would. Test-only.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_TIME_ENV = frozenset(
    ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTEST_CURRENT_TEST")
)
"""Variables each run sets for itself and nothing reads at import: runs that differ only in these share a server."""
MAX_SERVERS = 3
"""Servers a test process keeps (each holds its imports' memory, 0.5-1 GB); the least recently used one leaves."""
START_S = 300.0
"""How long a request may wait for its server's imports (on a loaded machine)."""


class ServerFailed(RuntimeError):
    """The server could not fork the run (its imports failed, or it did not answer): run it another way."""


@dataclass(frozen=True)
class Zygote:
    """A multi-rank run: the child forks `world` ranks as `megatron_ds.testing.zygote` does."""

    world: int
    status_file: str
    log_template: str


@dataclass
class Forked:
    """A forked run, as much of `subprocess.Popen` as the launchers use; `pid` leads the run's session."""

    pid: int
    exit_file: str
    server: subprocess.Popen
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(FileNotFoundError), open(self.exit_file) as f:
                self.returncode = int(f.read())
            if self.returncode is None and self.server.poll() is not None and not _alive(self.pid):
                self.returncode = -signal.SIGKILL  # the server died and cannot report it: gone, status unknown
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked run {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def fork(
    preload: Sequence[str],
    argv: Sequence[str],
    cwd: str | Path,
    env: dict[str, str],
    *,
    exit_file: str,
    streams: dict[str, str] | None = None,
    ranks: Zygote | None = None,
) -> Forked:
    """Start `python argv...` (`-m MODULE`, `-c CODE` or `SCRIPT.py`) in `cwd` with exactly `env`, forked from the
    server for (`preload`, `env`): with `streams` (`stdout`, `stderr`: file paths; the same path twice merges them)
    as that one process, with `ranks` as the zygote of a multi-rank run. Its exit status lands in `exit_file`."""
    if (streams is None) == (ranks is None):
        raise ValueError("fork takes one of streams (one process) or ranks (a multi-rank run)")
    request = {"argv": list(map(str, argv)), "cwd": str(cwd), "env": dict(env), "exit_file": exit_file}
    request.update(streams or {"output": _zygote_output(exit_file), **ranks.__dict__})
    with _lock:
        server = _server_for(tuple(preload), env)
        try:
            server.stdin.write(json.dumps(request).encode() + b"\n")
            pid = int(_reply(server, time.monotonic() + START_S))
        except (OSError, ValueError, TimeoutError) as err:
            _end(server)
            raise ServerFailed(f"the fork server for {list(preload)} did not start the run: {err}") from None
    return Forked(pid, exit_file, server)


def _zygote_output(exit_file: str) -> str:
    return exit_file + ".out"


def zygote_output(run: Forked) -> str:
    """What a multi-rank run's zygote itself printed (an error before it forked its ranks)."""
    return _zygote_output(run.exit_file)


# ----- the client's servers ------------------------------------------------------------------------

_servers: collections.OrderedDict[tuple, subprocess.Popen] = collections.OrderedDict()
_unread: dict[int, bytes] = {}  # per server pid: what it answered and no request has read yet
_lock = threading.Lock()


def _server_for(preload: tuple[str, ...], env: dict[str, str]) -> subprocess.Popen:
    key = (preload, tuple(sorted((k, v) for k, v in env.items() if k not in RUN_TIME_ENV)))
    server = _servers.pop(key, None)
    if server is None or server.poll() is not None:
        server = _start(preload, {k: v for k, v in env.items() if k not in RUN_TIME_ENV})
    _servers[key] = server
    while len(_servers) > MAX_SERVERS:
        _end(_servers.popitem(last=False)[1], wait=False)
    return server


def _start(preload: tuple[str, ...], env: dict[str, str]) -> subprocess.Popen:
    log = os.path.join(tempfile.gettempdir(), f"megatron_ds_fork_server_{os.getpid()}_{len(_unread)}.log")
    server = subprocess.Popen(
        [sys.executable, "-m", __name__, ",".join(preload)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(log, "w"),  # noqa: SIM115 - the server's own output (an import error), kept by it
        bufsize=0,
        cwd=str(ROOT),
        env=env,
        start_new_session=True,  # a signal to a test's run or to pytest's group is not for the server
    )
    server.log = log  # type: ignore[attr-defined]
    _unread[server.pid] = b""
    atexit.register(_end, server, False)
    return server


def _end(server: subprocess.Popen, wait: bool = True) -> None:
    """Close the server's input: it leaves after its last child (or now, if it is stuck: `wait` kills it)."""
    with contextlib.suppress(OSError):
        server.stdin.close()
    with contextlib.suppress(OSError):
        os.unlink(server.log)  # type: ignore[attr-defined]  # read only while the server is in use
    if wait:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=0.5)
        if server.poll() is None:
            server.kill()
            server.wait()
    for key, held in list(_servers.items()):
        if held is server:
            del _servers[key]


def _reply(server: subprocess.Popen, deadline: float) -> str:
    """The server's next line; TimeoutError at `deadline`, ValueError if it left (with what it printed). Read from
    the pipe itself, not a buffered reader, which could hold the next answer where `select` would not see it."""
    while b"\n" not in _unread[server.pid]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer within {START_S:.0f} s")
        ready, _, _ = select.select([server.stdout], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(server.stdout.fileno(), 4096)
            if not chunk:
                said = Path(server.log).read_text(errors="replace")[-3000:]  # type: ignore[attr-defined]
                raise ValueError(f"it exited with status {server.wait()}: {said}")
            _unread[server.pid] += chunk
    line, _, _unread[server.pid] = _unread[server.pid].partition(b"\n")
    return line.decode().strip()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ----- the server ----------------------------------------------------------------------------------


def _child(request: dict) -> None:
    """In the forked child: become the run `request` describes, run it, leave with its status."""
    from megatron_ds.testing import zygote

    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    paths = (request["stdout"], request["stderr"]) if "stdout" in request else (request["output"],) * 2
    opened: dict[str, int] = {}
    for fd, path in zip((1, 2), paths):
        if path not in opened:
            opened[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened[path], fd)
    for target in opened.values():
        os.close(target)
    argv = request["argv"]
    if "stdout" in request:
        zygote.leave_as_interpreter(lambda: run_as_main(argv))
    try:  # the zygote of a multi-rank run: `python -m megatron_ds.testing.zygote` past its imports
        sys.path[0] = os.getcwd()
        target = argv[1:] if argv[0] == "-m" else argv
        code = zygote.fork_ranks(request["status_file"], request["log_template"], request["world"], target)
    except BaseException:  # noqa: BLE001 - reported as the zygote's interpreter would, then its status
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_as_main(argv: list[str]) -> None:
    """`python argv...` in this process: `-m MODULE`, `-c CODE` or `SCRIPT.py`, each as `__main__`, with the
    `sys.argv` and `sys.path[0]` that interpreter would have."""
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - the test's own code
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _write_status(path: str, code: int) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(f"{code}\n")
    os.replace(path + ".tmp", path)  # whole or absent: the client never reads half a status


def main(preload: str) -> None:
    replies = os.fdopen(os.dup(1), "w")  # the answers to the client; what the imports print goes to the log
    os.dup2(2, 1)
    from megatron_ds.testing import zygote

    zygote.preload(preload)  # imports, then freezes them out of the collector's reach (see there)
    children: dict[int, str] = {}  # pid -> its exit file
    pending, reading = b"", True
    while reading or children:
        ready, _, _ = select.select([0] if reading else [], [], [], 0.05 if children else None)
        if ready:
            chunk = os.read(0, 65536)
            reading = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, _, pending = pending.partition(b"\n")
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    replies.close()
                    _child(request)
                children[pid] = request["exit_file"]
                print(pid, file=replies, flush=True)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in children:
                _write_status(children.pop(pid), os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1])
