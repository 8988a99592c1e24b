"""The one base class of user errors: bad flags, files, layouts or checkpoints.

Every error whose message a user should read derives from `UserError`; its message is one line
naming the flag or file, the bad value and the fix. Entry points (`pretrain_gpt.py`, `tools/`,
`python -m megatron_ds.plan`) print exactly these as `error: <message>` and exit with status 2,
with no traceback; anything else is a bug and keeps its traceback. Internal invariants use
`assert`. Leaf module: imports nothing from the project.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


class UserError(ValueError):
    """A user-fixable problem; the message names what is wrong, the value and the fix.

    A `ValueError` so callers that catch ValueError (argparse-style code, tests) keep working.
    """


class ConfigError(UserError):
    """A flag value, or a combination of config values, that cannot be run."""


class LayoutError(ConfigError):
    """A pipeline layout option that cannot be satisfied."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors (a missing or mistyped flag) are a `UserError`, so that the tool prints one
    `error:` line naming where its help is, not the whole usage text; `command` is how the help is asked for."""

    def __init__(self, *args: object, command: str, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.command = command

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message}; see `{self.command} --help`")


def first_line(err: BaseException) -> str:
    """An exception's first line for a one-line message (its type's name when it has no text): libraries' own
    messages (torch's, sentencepiece's) run over many lines."""
    return str(err).splitlines()[0] if str(err) else type(err).__name__


INTERRUPTED = "interrupted (Ctrl-C); outputs are moved into place only when complete, so none is half-written"
"""What a tool prints (as `error: ...`, exit status 130) when Ctrl-C stops it."""
EXIT_INTERRUPTED = 130
TERMINATED = "terminated (SIGTERM); outputs are moved into place only when complete, so none is half-written"
"""What a tool prints (exit status 143) when SIGTERM stops it (`timeout`, SLURM, `docker stop`, Kubernetes)."""
EXIT_TERMINATED = 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the tool is, so that its clean-up (temporary outputs removed) runs as for Ctrl-C."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def stop_cleanly_on_sigterm() -> None:
    """Make SIGTERM stop a tool as Ctrl-C does (its default ends the process at once, leaving temporary outputs)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def interrupted() -> int:
    """A tool's answer to Ctrl-C (or SIGTERM, `stop_cleanly_on_sigterm`): the one line on stderr, and the exit
    status to return. Call it in the `except KeyboardInterrupt` block."""
    if isinstance(sys.exc_info()[1], Terminated):
        print(f"error: {TERMINATED}", file=sys.stderr)
        return EXIT_TERMINATED
    print(f"error: {INTERRUPTED}", file=sys.stderr)
    return EXIT_INTERRUPTED


def tool_main(body: Callable[[], object], errors: tuple[type[BaseException], ...] = (UserError,)) -> int:
    """A tool's exit status around `body`: 0; 2 with the one `error:` line of any of `errors` (its message names
    the flag or file and the fix); Ctrl-C or SIGTERM as `interrupted` says. Anything else keeps its traceback."""
    try:
        body()
    except errors as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return interrupted()
    return 0
