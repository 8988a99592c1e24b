"""Process-group set-up (through DeepSpeed, which reads the launcher's environment)."""
from __future__ import annotations

import os
from datetime import timedelta

import torch

from megatron_ds.config import ParallelConfig


def default_backend(parallel: ParallelConfig) -> str:
    """`--distributed-backend`, else nccl on GPU and gloo on CPU."""
    if parallel.distributed_backend:
        return parallel.distributed_backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def env_world_size() -> int:
    """WORLD_SIZE as set by the launcher (1 when run as a plain script)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(parallel: ParallelConfig) -> None:
    """Initialise torch.distributed once; collectives time out after the configured minutes."""
    import deepspeed

    if torch.distributed.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    deepspeed.init_distributed(dist_backend=default_backend(parallel), auto_mpi_discovery=False,
                               timeout=timedelta(minutes=parallel.distributed_timeout_minutes),
                               verbose=False)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
