"""Shared test settings: CPU only, one thread per rank, torch extensions cached in one place; DeepSpeed's CPU Adam
op compiled in the background while the single-process tests run."""

import os
import subprocess
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# megatron-core wraps some fused functions in torch.compile (our trainer never compiles); eager runs the same
# formulas, where inductor's C++ build would cost minutes of CPU on a fresh machine (its cache is per checkout).
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# Not DeepSpeed's shared-memory all-reduce op, which deepspeed.init_distributed on the CPU accelerator would compile
# (a minute of CPU; inside a forked-rank test's timeout on a loaded 2-core machine): only DeepSpeed-inference uses it,
# and every process group the tests make is started past it (`megatron_ds.distributed.skip_cpu_shared_memory_allreduce`,
# which the test scripts that call deepspeed.init_distributed themselves call first).
_BUILD_OPS = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)"
_build: subprocess.Popen | None = None


def pytest_collection_finish(session: pytest.Session) -> None:
    """When multi-rank runs are selected, compile DeepSpeed's CPU Adam (a few minutes of CPU on 2 cores, once per
    environment) now, so that the `--cpu-optimizer` and offload runs find it built (or wait on its build lock, as
    they would for their own build). Already built: they load in a
    second. In one process the unit tier runs first (pytest.ini's testpaths) and leaves a core idle, so the build
    takes the lowest priority; under pytest-xdist (`make test`) no core is idle, so one worker builds at normal
    priority rather than starve the build behind the tests."""
    global _build
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker not in (None, "gw0") or not any(i.path.parent.name in ("dist", "e2e") for i in session.items):
        return
    _build = subprocess.Popen(
        [sys.executable, "-c", _BUILD_OPS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=(lambda: os.nice(19)) if worker is None else None,
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Wait for the build rather than kill it: a build killed mid-way leaves its lock, and the next load waits on it."""
    if _build is not None and _build.poll() is None:
        try:
            _build.wait(timeout=600)
        except subprocess.TimeoutExpired:
            _build.kill()
