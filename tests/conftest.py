"""Shared test settings: CPU only, one thread per rank, torch extensions cached in one place; DeepSpeed's
shared-memory communication and CPU Adam ops compiled in the background while the single-process tests run."""

import os
import subprocess
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# megatron-core wraps some fused functions in torch.compile (our trainer never compiles); eager runs the same
# formulas, where inductor's C++ build would cost minutes of CPU on a fresh machine (its cache is per checkout).
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# The shared-memory op first: every deepspeed.init_distributed on the CPU accelerator loads it (TorchBackend's
# build_shm_op), so without it the first multi-rank test compiles it (a minute of CPU) inside its own timeout: two
# forked-rank tests (120 s) timed out on a loaded 2-core machine doing so. Then CPU Adam.
_BUILD_OPS = (
    "from deepspeed.accelerator import get_accelerator; "
    "get_accelerator().create_op_builder('ShareMemCommBuilder').load(verbose=False); "
    "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)"
)
_build: subprocess.Popen | None = None


def pytest_collection_finish(session: pytest.Session) -> None:
    """When multi-rank runs are selected, compile DeepSpeed's shared-memory op and CPU Adam (about a minute each on
    2 cores, once per environment) now, so that the multi-rank runs and the `--cpu-optimizer` and offload runs find
    them built (or wait on their build lock, as they would for their own build). Already built: they load in a
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
