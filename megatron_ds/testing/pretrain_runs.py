"""Run `pretrain_gpt.py` (or `finetune_llama.py`) on N local ranks from a test, as `torchrun --nproc_per_node N`
would, but with the ranks forked from one process that imported the training stack once (`megatron_ds.testing.zygote`).

The ranks get torchrun's rendezvous variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and the result is torchrun's: one exit status (0 when every rank exits 0) and one output, here
each rank's in rank order rather than interleaved. Tests of the launcher itself (tests/e2e/test_pretrain_gpt.py,
the demo) keep the real `torchrun`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

from megatron_ds.testing.launch import Ranks, start_ranks
from megatron_ds.testing.zygote import RUN_PRELOAD

ROOT = Path(__file__).resolve().parents[2]


def start_pretrain_gpt(
    nproc: int, argv: Sequence[str], cwd: str | None = None, env: dict | None = None, script: str = "pretrain_gpt.py"
) -> Ranks:
    """`run_pretrain_gpt`'s ranks, started and not waited for (`Ranks.exit_times`, `Ranks.finish`)."""
    env = {"DS_ACCELERATOR": "cpu", **(env or {})}  # what pretrain_gpt.py sets on a machine without CUDA
    script = str(ROOT / script)
    return start_ranks([script, *argv], nproc, cwd=cwd or str(ROOT), env=env, preload=RUN_PRELOAD)


def run_pretrain_gpt(
    nproc: int,
    argv: Sequence[str],
    timeout: float,
    cwd: str | None = None,
    env: dict | None = None,
    script: str = "pretrain_gpt.py",
) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc pretrain_gpt.py argv...` (`script`: another of ours) under a hard timeout: on
    timeout every rank dumps its stack and is killed, and the output ends with `[launch] killed after ...` (as
    `run_torchrun`'s)."""
    ranks = start_pretrain_gpt(nproc, argv, cwd, env, script)
    script = str(ROOT / script)
    results = ranks.finish(timeout, check=False)
    output = "".join(r.output for r in results)
    if any(r.returncode is None for r in results):
        return subprocess.CompletedProcess(
            [script, *argv], -9, output + f"\n[launch] killed after {timeout:.0f}s timeout\n"
        )
    code = next((r.returncode for r in results if r.returncode != 0), 0)
    return subprocess.CompletedProcess([script, *argv], code, output)
