"""Process-group set-up (through DeepSpeed, which reads the launcher's environment) and teardown.

Why teardown matters: gloo runs every collective on worker threads, and a worker drops its last
reference to a finished operation (and to the tensors it holds) a moment after the caller saw the
result. If the interpreter is already finalising when that happens, releasing the tensor needs
the GIL, the thread is unwound mid-destructor and the process dies with SIGABRT ("terminate
called without an active exception") after it trained and saved. DeepSpeed's pipeline engine
makes this likely: its point-to-point sends are broadcasts over one subgroup per stage pair. So
every entry point ends with `shutdown_distributed` (a closing barrier, then every group destroyed)
while the interpreter is fully alive, and a script leaves through `exit_process`: a gloo group's
threads end only with the last reference to the group, which DeepSpeed's engine keeps until
finalisation, so after process groups the interpreter is not finalised at all (see there). (The
watchdog exits with `os._exit` too.)
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

from megatron_ds.config import ParallelConfig

TEARDOWN_STUCK_EXIT_CODE = 4
"""Exit status when destroying the process groups does not finish in time (see `shutdown_distributed`)."""

_had_process_groups = False
"""Set by `init_distributed` and `shutdown_distributed` when this process had process groups: `exit_process` then skips finalisation."""


def default_backend(parallel: ParallelConfig) -> str:
    """`--distributed-backend`, else nccl on GPU and gloo on CPU."""
    if parallel.distributed_backend:
        return parallel.distributed_backend
    import torch  # here, not at the top: a script's launch-line errors and exit path need no torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def env_world_size() -> int:
    """WORLD_SIZE as set by the launcher (1 when run as a plain script)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(parallel: ParallelConfig) -> None:
    """Initialise torch.distributed once; collectives time out after the configured minutes."""
    import deepspeed
    import torch

    global _had_process_groups

    if torch.distributed.is_initialized():
        return
    _had_process_groups = True
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if env_world_size() == 1:
        # Port 0: the store binds a port the kernel picks, atomically. A port found free and bound later
        # can be taken in between by another run's connections (EADDRINUSE under parallel test workers).
        # More ranks need the launcher's MASTER_PORT; torch names it when it is missing.
        os.environ.setdefault("MASTER_PORT", "0")
    skip_cpu_shared_memory_allreduce()
    deepspeed.init_distributed(
        dist_backend=default_backend(parallel),
        auto_mpi_discovery=False,
        timeout=timedelta(minutes=parallel.distributed_timeout_minutes),
        verbose=False,
    )


def skip_cpu_shared_memory_allreduce() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory all-reduce when it starts.

    Only DeepSpeed-inference's `inference_all_reduce` uses that op; training never does. Building it
    costs ~25 s on a fresh machine, and a process killed mid-build leaves torch's extension lock file
    behind, after which every later start on that machine waits on the lock forever (a CI run
    inherited such a lock and every multi-rank test stalled). No-op off CPU.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        # DeepSpeed caches this dict on first access and reads it before building an op.
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def shutdown_distributed(clean: bool = True, timeout_s: float = 120.0) -> None:
    """Finish outstanding communication and destroy every process group (ours, DeepSpeed's and
    megatron-core's): a group no one else holds ends its gloo worker threads here; those of groups
    DeepSpeed's engine still holds live on, which is why a script then leaves through
    `exit_process`. Safe to call when no process group exists.

    `clean=True` (normal exit): a barrier first, so every rank has finished its collectives and
    destroying the groups here cannot strand a peer. `clean=False` (error exit): peers may be
    gone, so no barrier; only this rank's groups are torn down. Either way the teardown is
    bounded: if it has not finished after `timeout_s` (a peer died mid-operation), the rank says
    so and leaves with `TEARDOWN_STUCK_EXIT_CODE` instead of hanging.
    """
    import torch.distributed as dist

    global _had_process_groups

    if not (dist.is_available() and dist.is_initialized()):
        return
    _had_process_groups = True
    rank = dist.get_rank()
    finished = threading.Event()
    failure: list[BaseException] = []

    def teardown() -> None:
        try:
            if clean:
                dist.barrier()
            forget_megatron_core_groups()
            dist.destroy_process_group()  # all groups: shuts down and joins each backend's threads
        except BaseException as exc:  # noqa: BLE001 - reported by the caller's thread below
            failure.append(exc)
        finally:
            finished.set()

    worker = threading.Thread(target=teardown, name="megatron_ds-teardown", daemon=True)
    worker.start()
    if not finished.wait(timeout_s):
        print(
            f"[teardown] rank {rank}: destroying the process groups did not finish within {timeout_s:.0f}s "
            f"(a peer may have exited mid-operation); exiting with status {TEARDOWN_STUCK_EXIT_CODE}",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(TEARDOWN_STUCK_EXIT_CODE)
    if failure:
        raise failure[0]


def exit_process(code: int | str | None) -> NoReturn:
    """End the process with `code` as `sys.exit(code)` would (non-daemon threads joined, atexit handlers run,
    stdout and stderr flushed), but, once this process has had process groups, without finalising the interpreter.

    Why: destroying the groups shuts gloo's down, yet a group's worker threads only end when the last reference to
    it goes, and DeepSpeed's pipeline engine keeps its groups until the interpreter frees it at finalisation (an
    output tensor's backward hook holds the engine, and the autograd graph holds the tensor: a cycle through C++
    that the garbage collector cannot see; DeepSpeed's module globals hold more groups). A worker letting go of its
    last collective releases the tensor's Python object, which needs the GIL; if the interpreter has begun to
    finalise by then, taking the GIL unwinds the thread inside a destructor and the rank dies with SIGABRT
    ("terminate called without an active exception", or SIGSEGV) after it printed its line. A clean exit's
    closing barrier makes that rare; an error skips it, and a 2-stage run stopped by a NaN loss or a token id
    outside the vocabulary died so in 4 launches of 175. `os._exit` ends the worker threads with the process
    instead: nothing is finalised, so nothing is unwound.
    """
    if not isinstance(code, int):  # sys.exit's rules: None is 0, anything else is printed and is 1
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    if not _had_process_groups:
        sys.exit(code)
    try:
        for thread in threading.enumerate():  # what finalisation would wait for first
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()  # logging's flush, multiprocessing's children, wandb's finish
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said
                pass
        os._exit(code)


def run_and_exit(entry: Callable[..., int | str | None], *args: object) -> NoReturn:
    """Run a process's entry point and leave through `exit_process` with its status: a returned code, a `SystemExit`'s
    code, or 1 for an uncaught exception (printed as the interpreter prints it). Every script or worker that creates
    process groups ends so (pretrain_gpt.py, the test scenarios, the benchmarks' workers)."""
    try:
        code = entry(*args)
    except SystemExit as exc:
        code = exc.code
    except Exception:  # noqa: BLE001 - reported as an uncaught exception would be, then the status
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_process(code)


def forget_megatron_core_groups() -> None:
    """Drop megatron-core's module-global groups (at teardown, and before a process builds another model)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
