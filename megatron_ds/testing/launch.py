"""Run a Python entry point on N local ranks (gloo on CPU) under a hard timeout.

On timeout every rank is asked (SIGUSR1) to dump its Python stack, then killed, and the error
names the ranks that had not finished with the tail of their output, so a hang in a test is a
failure that says which rank stalled where, never a stuck CI job.
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_module
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_ds.testing import fork_server


class RanksFailed(AssertionError):
    """Some rank exited non-zero or did not finish in time."""


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    output: str


def free_port() -> int:
    """A port to serve the rendezvous on, free now, below the kernel's ephemeral range: a port the kernel hands out
    (bind to 0) can be taken again, before the store listens on it, by the outgoing connections of the other
    runs' ranks (EADDRINUSE in parallel test workers); ports below the range are never given to those."""
    low = _ephemeral_low()
    rng = random.Random()  # not the tests' seeded global generator
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that whole range in use: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port the kernel picks for outgoing connections (Linux; 32768 elsewhere, its default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def rank_env(rank: int, world_size: int, port: int, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "MEGATRON_DS_STACK_ON_SIGUSR1": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env


def run_ranks(
    argv: Sequence[str],
    world_size: int,
    timeout: float,
    cwd: str | None = None,
    env: dict | None = None,
    check: bool = True,
    preload: Sequence[str] = (),
) -> list[RankResult]:
    """Start `python argv...` once per rank; wait at most `timeout` seconds for all of them."""
    return start_ranks(argv, world_size, cwd, env, preload).finish(timeout, check)


@dataclass
class Ranks:
    """Ranks started by `start_ranks`, each in a session of its own (forked ones: in their zygote's) with its
    output in a log file."""

    procs: list
    logs: list
    zygote: subprocess.Popen | fork_server.Forked | None = None
    zygote_files: tuple[str, ...] = ()
    """The zygote's status file and its own output (an import error before any fork shows there)."""

    def output(self, rank: int) -> str:
        """What `rank` has written so far."""
        with open(self.logs[rank].name) as f:
            return f.read()

    def signal(self, sig: int) -> None:
        """Send `sig` to every rank still running (as a terminal's Ctrl-C or a scheduler's SIGTERM does): once to
        each process group (forked ranks share their zygote's, so each still gets it once)."""
        running = {p.pid: p for p in self.procs if p.poll() is None}
        for p in running.values():
            _signal(p, sig)

    def exit_times(self, timeout: float) -> dict[int, float]:
        """Wait at most `timeout` seconds for every rank to exit; when each did (`time.monotonic()`), by rank (a rank
        still running then is missing). `finish` collects them (and kills what is left) after."""
        exited: dict[int, float] = {}
        deadline = time.monotonic() + timeout
        while len(exited) < len(self.procs) and time.monotonic() < deadline:
            now = time.monotonic()
            exited.update({r: now for r, p in enumerate(self.procs) if r not in exited and p.poll() is not None})
            time.sleep(0.05)
        return exited

    def finish(self, timeout: float, check: bool = True) -> list[RankResult]:
        """Wait at most `timeout` seconds; ranks still running then dump their stacks and are killed."""
        deadline = time.monotonic() + timeout
        timed_out = _wait_all(self.procs, deadline)
        if timed_out:
            self.signal(signal.SIGUSR1)
            time.sleep(3.0)
            for p in self.procs:
                if p.poll() is None:
                    _signal(p, signal.SIGKILL)
                    p.wait()
        results = []
        for rank, (p, log) in enumerate(zip(self.procs, self.logs)):
            log.seek(0)
            results.append(RankResult(rank, None if rank in timed_out else p.returncode, log.read()))
            log.close()
            os.unlink(log.name)
        self._finish_zygote(results)
        if check:
            _raise_on_failure(results, timeout)
        return results

    def _finish_zygote(self, results: list[RankResult]) -> None:
        if self.zygote is None:
            return
        try:
            self.zygote.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _signal(self.zygote, signal.SIGKILL)
            self.zygote.wait()
        with open(self.zygote_files[1]) as f:
            said = f.read().strip()
        for path in self.zygote_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if said:
            for r in results:
                if r.returncode != 0:
                    r.output += f"\n[zygote] {said}"


def start_ranks(
    argv: Sequence[str],
    world_size: int,
    cwd: str | None = None,
    env: dict | None = None,
    preload: Sequence[str] = (),
) -> Ranks:
    """Start `python argv...` once per rank without waiting; `Ranks.finish` waits under a hard timeout.

    With `preload` (modules; `argv` must be `-m MODULE ARGS...` or `SCRIPT.py ARGS...`) the ranks are forked
    from one process (`megatron_ds.testing.zygote`), itself forked from this test process's server that imported
    those modules once (`megatron_ds.testing.fork_server`): the same run without each launch's seconds of imports."""
    port = free_port()
    logs = [open(_log_path(rank, port), "w+") for rank in range(world_size)]
    if preload:
        return _fork_ranks(argv, logs, cwd, rank_env(0, world_size, port, env), preload, port)
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
            cwd=cwd,
            env=rank_env(rank, world_size, port, env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for rank, log in enumerate(logs)
    ]
    return Ranks(procs, logs)


@dataclass
class ForkedRank:
    """One rank forked by a zygote: Popen's `pid`, `poll`, `wait` and `returncode`, read from the zygote's
    status file. Every rank shares the zygote's process group (its `pid` here), so a signal reaches all."""

    rank: int
    zygote: subprocess.Popen | fork_server.Forked
    status_file: str
    returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.zygote.pid

    def poll(self) -> int | None:
        if self.returncode is None:
            zygote_done = self.zygote.poll() is not None  # first: once it has exited, its file is complete
            with open(self.status_file) as f:
                codes = dict(line.split() for line in f if line.strip())
            if str(self.rank) in codes:
                self.returncode = int(codes[str(self.rank)])
            elif zygote_done:  # it died before forking or reaping this rank
                self.returncode = self.zygote.returncode or -signal.SIGKILL
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.05)
        return self.returncode


def _fork_ranks(
    argv: Sequence[str], logs: list, cwd: str | None, env: dict, preload: Sequence[str], port: int
) -> Ranks:
    target = list(argv[1:]) if argv and argv[0] == "-m" else list(argv)  # MODULE ARGS... or SCRIPT.py ARGS...
    if not target or (argv[0] != "-m" and not str(target[0]).endswith(".py")):
        raise ValueError(f"preload needs argv '-m MODULE ...' or 'SCRIPT.py ...', got {list(argv)[:2]}")
    status_file, exit_file = _log_path("status", port), _log_path("exit", port)
    open(status_file, "w").close()
    ranks = fork_server.Zygote(len(logs), status_file, _log_path("{rank}", port))
    try:  # from this test process's server for these imports: no fresh interpreter to import them
        zygote = fork_server.fork(preload, argv, cwd or os.getcwd(), env, exit_file=exit_file, ranks=ranks)
        files = (status_file, fork_server.zygote_output(zygote), exit_file)
    except fork_server.ServerFailed:  # a fresh zygote, which reports what went wrong as the run's failure
        zygote, files = _fresh_zygote(target, cwd, env, preload, ranks, _log_path("zygote", port))
    procs = [ForkedRank(rank, zygote, status_file) for rank in range(len(logs))]
    return Ranks(procs, logs, zygote, files)


def _fresh_zygote(
    target: list, cwd: str | None, env: dict, preload: Sequence[str], ranks: fork_server.Zygote, output_file: str
) -> tuple[subprocess.Popen, tuple[str, ...]]:
    """`python -m megatron_ds.testing.zygote ...`: its own interpreter, which imports `preload` itself."""
    with open(output_file, "w") as out:
        zygote = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megatron_ds.testing.zygote",
                ranks.status_file,
                ranks.log_template,
                str(ranks.world),
                ",".join(preload),
                *target,
            ],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return zygote, (ranks.status_file, output_file)


def _log_path(rank: int | str, port: int) -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"megatron_ds_rank{rank}_{port}_{os.getpid()}.log")


def _wait_all(procs: list, deadline: float) -> set[int]:
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in procs):
            return set()
        if any(p.poll() not in (None, 0) for p in procs):
            # One rank failed: give the others a moment to fail too, then stop waiting.
            deadline = min(deadline, time.monotonic() + 20.0)
        time.sleep(0.1)
    return {i for i, p in enumerate(procs) if p.poll() is None}


def signal_group(pid: int, sig: int) -> bool:
    """`sig` to the process group (session) that `pid` leads; False when it is already gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _signal(p: subprocess.Popen | fork_server.Forked, sig: int) -> None:
    signal_group(p.pid, sig)


def _raise_on_failure(results: list[RankResult], timeout: float) -> None:
    bad = [r for r in results if r.returncode != 0]
    if not bad:
        return
    parts = []
    for r in bad:
        what = f"stalled (no exit within {timeout:.0f}s)" if r.returncode is None else f"exited {r.returncode}"
        parts.append(f"--- rank {r.rank} {what}; last output:\n{r.output[-6000:]}")
    raise RanksFailed("\n".join(parts))


def run_torchrun(
    nproc: int, argv: Sequence[str], timeout: float, cwd: str | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N argv...` (the real launcher) under a hard timeout.

    On timeout every process gets SIGUSR1 (our ranks print their stacks), then SIGKILL, and the
    result has returncode None-like -9 with the output so far; never waits forever.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        *argv,
    ]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal(proc, signal.SIGUSR1)
        time.sleep(3.0)
        _signal(proc, signal.SIGKILL)
        out, _ = proc.communicate()
        return subprocess.CompletedProcess(cmd, -9, out + f"\n[launch] killed after {timeout:.0f}s timeout\n")
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


TEARDOWN_S = 5.0
"""How long `forked_gloo_ranks` waits for a rank that answered to leave before killing it."""


def forked_gloo_ranks(
    target: Callable[..., Any], world_size: int, store: str, *args: Any, timeout: float = 120.0
) -> list:
    """`target(rank, *args)` on `world_size` ranks forked from this process (nothing imported again), each in a gloo
    group over the file store `store`; returns each rank's result (an exception's message in its place). A rank that
    has not answered within `timeout` seconds is killed and named: a stalled rank never outlives the test."""
    import multiprocessing

    import torch.distributed  # noqa: F401  here, once: ranks importing it after the fork took 18 s under load

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_gloo_rank, args=(r, world_size, store, queue, target, args)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(results) < world_size and time.monotonic() < deadline:
            with contextlib.suppress(queue_module.Empty):
                rank, value = queue.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
                results[rank] = value
    finally:
        for rank, p in enumerate(procs):
            # One that answered is tearing down its group (well under a second); one still there after TEARDOWN_S is
            # stuck in it (seen under pytest-xdist: 30 s per rank) and is killed: its answer is already in.
            p.join(timeout=TEARDOWN_S if rank in results else 0)
            if p.is_alive():
                p.kill()
    stalled = sorted(set(range(world_size)) - set(results))
    if stalled:
        raise RanksFailed(f"rank(s) {stalled} gave no result within {timeout:.0f}s (killed); the others: {results}")
    return [results[r] for r in range(world_size)]


def _gloo_rank(rank: int, world_size: int, store: str, queue: Any, target: Callable[..., Any], args: tuple) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    try:
        queue.put((rank, target(rank, *args)))
    except Exception as err:  # the rank's answer: its error's message (a one-line error is what tests look at)
        queue.put((rank, str(err)))
    finally:
        dist.destroy_process_group()
