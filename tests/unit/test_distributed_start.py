"""Starting torch.distributed through DeepSpeed on CPU builds nothing, so a stale build lock cannot stall it."""

import os
import subprocess
import sys
from pathlib import Path

from megatron_ds.testing.launch import free_port

START = """
import deepspeed
from megatron_ds.config import ParallelConfig
from megatron_ds.distributed import init_distributed, shutdown_distributed
init_distributed(ParallelConfig())
print("SHM_OP", deepspeed.comm.comm.cdb.shm_comm_op)
shutdown_distributed()
"""


def test_start_ignores_a_stale_extension_lock(tmp_path: Path) -> None:
    # What a process killed while JIT-compiling DeepSpeed's shm op leaves behind: torch's lock file.
    # Any later process that tries to build the op waits on it forever.
    stale = tmp_path / "ext" / "py311_cpu" / "deepspeed_shm_comm"
    stale.mkdir(parents=True)
    (stale / "lock").touch()
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
        "DS_ACCELERATOR": "cpu",
        "MASTER_PORT": str(free_port()),
    }
    out = subprocess.run([sys.executable, "-c", START], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SHM_OP None" in out.stdout, out.stdout[-2000:]
