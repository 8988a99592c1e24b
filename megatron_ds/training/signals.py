"""What SIGINT (Ctrl-C) and SIGTERM do to a rank.

Without `--exit-signal-handler` both stop the rank at once: one line on stderr, then `os._exit`
with 128 + the signal number. No exception travels through DeepSpeed's communication (which would
print a traceback on every rank and, on the ranks still waiting on the one that left, a second one
from the closed connection) and no interpreter shutdown runs while gloo's threads are busy
(`megatron_ds.distributed` explains the abort that causes). Every rank gets the signal (Ctrl-C
goes to the terminal's whole process group; launchers and schedulers forward SIGTERM to each
rank), so every rank says its one line within a fraction of a second.

With `--exit-signal-handler` (Megatron's flag) SIGTERM only sets a flag: the loop finishes the
step in progress, all ranks agree through one all-reduce per step (`stop_requested`),
save a checkpoint and exit with status 0; `--load` resumes from it exactly. SIGINT still stops at once.

Processes forked after `install` (DataLoader workers) inherit the handlers and leave silently.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

HANDLED = (signal.SIGINT, signal.SIGTERM)


class ExitSignals:
    """This process's handling of SIGINT and SIGTERM (one instance, `install`)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.save_on_sigterm = False
        """`--exit-signal-handler`: SIGTERM finishes the step, saves and exits 0."""
        self.received: int | None = None
        """The signal number a deferred SIGTERM set (None: none)."""
        self.progress: Callable[[], str] = lambda: "while starting"
        """Where the run is, for the one line (the loop points it at its iteration)."""

    def _quit(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid:  # a forked DataLoader worker: its parent speaks for it
            os._exit(128 + signum)
        name = signal.Signals(signum).name
        fix = "; --exit-signal-handler saves a checkpoint on SIGTERM" if signum == signal.SIGTERM else ""
        try:
            where = self.progress()
        except Exception:  # noqa: BLE001 - the line must come out whatever state the loop is in
            where = "while running"
        _say(f"{name}: stopped {where}, without saving (the last checkpoint, if any, is kept){fix}")
        os._exit(128 + signum)

    def _defer(self, signum: int, frame: FrameType | None) -> None:
        if not self.save_on_sigterm or os.getpid() != self.pid:
            self._quit(signum, frame)
        if self.received is None:
            self.received = signum
            if _rank() == 0:
                _say(
                    f"{signal.Signals(signum).name}: finishing this step, then saving and exiting (--exit-signal-handler)"
                )


_CURRENT: ExitSignals | None = None


_PREVIOUS: dict[int, Any] = {}


def install() -> ExitSignals:
    """Handle SIGINT and SIGTERM in this (main) thread; returns the process's handler, made once."""
    global _CURRENT
    if _CURRENT is None or _CURRENT.pid != os.getpid():
        _CURRENT = ExitSignals()
    for sig, handler in ((signal.SIGINT, _CURRENT._quit), (signal.SIGTERM, _CURRENT._defer)):
        previous = signal.signal(sig, handler)
        _PREVIOUS.setdefault(sig, previous)
    return _CURRENT


def uninstall() -> None:
    """Give SIGINT and SIGTERM back their handlers from before `install` (a caller that runs
    `pretrain_gpt.main` in-process, such as a test, keeps its Ctrl-C)."""
    global _CURRENT
    for sig, previous in _PREVIOUS.items():
        signal.signal(sig, previous)
    _PREVIOUS.clear()
    _CURRENT = None


def current() -> ExitSignals | None:
    """The handler `install` made in this process, if any."""
    return _CURRENT if _CURRENT is not None and _CURRENT.pid == os.getpid() else None


def set_progress(progress: Callable[[], str]) -> None:
    """Where the run is, for the one line a stopping signal prints (`in iteration 7`)."""
    handler = current()
    if handler is not None:
        handler.progress = progress


def stop_requested(enabled: bool, device: Any, watchdog: Any = None) -> bool:
    """With `--exit-signal-handler` (`enabled`, the same on every rank): whether some rank got SIGTERM,
    the same answer on every rank (a collective every rank calls at the same step, under `watchdog`'s
    timer when given, as every collective of the loop)."""
    if not enabled:
        return False
    import torch
    import torch.distributed as dist

    handler = current()
    flag = torch.tensor([0.0 if handler is None or handler.received is None else 1.0], device=device)
    with watchdog.watch("the --exit-signal-handler check") if watchdog is not None else contextlib.nullcontext():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _say(text: str) -> None:
    prefix = f"[rank {_rank()}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):  # RuntimeError: a reentrant flush mid-print
            pass
    try:
        sys.stderr.write(f"{prefix}{text}\n")
        sys.stderr.flush()
    except (OSError, ValueError, RuntimeError):
        pass
