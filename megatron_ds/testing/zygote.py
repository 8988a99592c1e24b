"""Start every rank of one multi-rank test run from one process that imported the heavy libraries once.

    python -m megatron_ds.testing.zygote STATUS_FILE LOG_TEMPLATE WORLD PRELOAD MODULE|SCRIPT.py [ARGS...]

Each rank of a test run spends about 3 s of CPU importing torch, DeepSpeed, torch's compiler stack
(which `torch.optim` imports at the first optimizer) and, at T > 1, megatron-core; on a 2-core machine
that start-up, not the training, is most of a multi-rank test. Here one process imports `PRELOAD` (a
comma-separated list of modules; `module:function` also calls that function) and then forks one child per
rank, as torch's DataLoader forks its workers: each child sets its `RANK`/`LOCAL_RANK`, writes to
`LOG_TEMPLATE.format(rank=rank)` and runs `MODULE` as `python -m MODULE ARGS...` (or `SCRIPT.py` as
`python SCRIPT.py ARGS...`) would. Nothing before the fork starts a thread pool, a process group or a random
stream (torch's import keeps its one idle native thread, which a fork leaves behind as it does for DataLoader
workers).

The children stay in this process's group (the launcher starts it in a session of its own), so one
`killpg` reaches every rank. This process ignores the signals the launcher sends to the group, reaps the
children, and appends `<rank> <exit status>` to STATUS_FILE as each one ends (a negative status: killed
by that signal). Used by `megatron_ds.testing.launch.start_ranks(..., preload=...)`; test-only.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import runpy
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

RUN_PRELOAD = (
    "torch",
    "torch._dynamo",  # torch.optim imports it at the first optimizer: a second of CPU per rank
    "deepspeed",
    # DeepSpeed's ZeRO and bf16 optimizers import Muon at their first engine, and its `torch.compile` decorator
    # imports torch's inductor: 2-3 s of CPU in every such rank
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "megatron_ds.distributed",
    "megatron_ds.flags.parser",
    "megatron_ds.testing.scenario",
    "megatron_ds.training.builder",
    "megatron_ds.training.checkpoint.save_load",
    "megatron_ds.training.launch_checks",
    "megatron_ds.training.loop",
    "megatron_ds.training.machine",
    "megatron_ds.training.signals",
    # megatron-core: its layers at T > 1, its datasets for files given by path, its own training (Megatron-LM's
    # checkpoints made by its code)
    "megatron_ds.model.tensor_parallel_layers",
    "megatron_ds.data.indexed:megatron_indexed_dataset_module",
    "megatron.core.datasets.gpt_dataset",
    "megatron.core.datasets.blended_dataset",
    "megatron.core.models.gpt",
    "megatron.core.dist_checkpointing",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    # DeepSpeed's CPU Adam asks py-cpuinfo (a process per question) in every rank whose optimizer is on the host
    "megatron_ds.testing.zygote:answer_cpu_info_once",
)
"""What the tests' runs import before their work, the union of what each kind needs (scenarios, pretrain_gpt.py,
the tools, Megatron-LM's own training): every launcher forks from servers that imported it
(`megatron_ds.testing.fork_server` keeps one per environment), so a test process imports it once or twice, not
once per kind of run as when each launcher had its own list and the servers for five lists took turns (36 server
starts, ~6 s of CPU each, in one run of the suite). Extra modules in a run that does not use them cost nothing."""
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
"""Signals the launcher sends to the whole group: the ranks act on them, this process must not."""


def answer_cpu_info_once() -> None:
    """py-cpuinfo's `get_cpu_info` starts a Python process per call (about 1 s of CPU) and DeepSpeed's CPU Adam
    asks it several times per rank; ask once here, and every rank reads the same answer from memory."""
    import cpuinfo

    info = cpuinfo.get_cpu_info()
    cpuinfo.get_cpu_info = lambda: dict(info)


def _run_rank(rank: int, log_template: str, module: str, args: list[str]) -> None:
    """In the child: become rank `rank`, run `module` (or a script) as `__main__`, and leave with its exit status."""
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    fd = os.open(log_template.format(rank=rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)

    def run() -> None:
        sys.argv = [module, *args]
        if module.endswith(".py"):
            sys.path[0] = os.path.dirname(os.path.abspath(module))  # as `python SCRIPT.py` sets it
            runpy.run_path(module, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)

    leave_as_interpreter(run)


def leave_as_interpreter(run: Callable[[], object]) -> NoReturn:
    """In a forked child: call `run` (a script as `__main__`) and end the process as an interpreter would end it,
    with status 0, SystemExit's code (its message on stderr) or a traceback and 1, after the atexit functions
    (logging's flush, ...); never return into the forking process's own code."""
    code = 1
    try:
        run()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as a fresh interpreter would, then the status
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def preload(names: str) -> None:
    """Import each of the comma-separated `names` (`module:function` also calls that function), then freeze what
    this process holds out of the garbage collector's reach in the children it forks. Why: every full collection
    walks all live objects, and after torch, DeepSpeed and megatron-core that is ~430,000 (0.2-0.5 s a `gc.collect()`); DeepSpeed
    collects explicitly (its bf16 optimizer six times per engine, each memory report once), so a rank spent
    seconds walking the imported libraries' objects, which never become garbage. Python's docs advise the same
    before forking (it also spares the copy-on-write of the pages the collector would touch)."""
    for name in filter(None, names.split(",")):
        module_name, _, function = name.partition(":")
        loaded = importlib.import_module(module_name)
        if function:
            getattr(loaded, function)()
    gc.collect()  # what is garbage now is freed, not frozen
    gc.freeze()


def main(argv: list[str]) -> int:
    status_file, log_template, world, names, *target = argv
    preload(names)
    return fork_ranks(status_file, log_template, int(world), target)


def fork_ranks(status_file: str, log_template: str, world: int, target: list[str]) -> int:
    """Fork `world` ranks running `target` (MODULE or SCRIPT.py, then its args), reap them, and record each one's
    status in `status_file`; 0 when every rank exited 0. Also the zygote forked by `megatron_ds.testing.fork_server`."""
    module, *args = target
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, log_template, module, args)
        children[pid] = rank
    worst = 0
    while children:
        pid, status = os.wait()
        rank = children.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        with open(status_file, "a") as f:
            f.write(f"{rank} {code}\n")
        worst = worst or code
    return 0 if worst == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
