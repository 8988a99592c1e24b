"""What the merged DeepSpeed JSON may say about ZeRO, checked before any process starts.

The flags (`--zero-stage`, `--offload-optimizer`, `--cpu-optimizer`, `--offload-param`) decide the
optimizer this run builds, the engine it runs on and what the memory model counts, so the JSON a user
file adds may not move them elsewhere: a user file's offload device that the flags do not give is
an error naming the flag that gives it (never silently taken). And before launch, facts of the
machine the run starts on (`check_offload_runs_here`; `--print-layout` warns instead, as a login node
previews a GPU node's run): the NVMe directory exists and is writable, the ops offload needs build
here, and the host memory the memory model predicts for offload is available.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_ds.config import Config
from megatron_ds.errors import UserError
from megatron_ds.units import format_bytes


class ZeroConfigError(UserError):
    """The DeepSpeed JSON's ZeRO section contradicts the flags, or names an unusable NVMe path."""


_FLAGS = {"offload_optimizer": "--offload-optimizer", "offload_param": "--offload-param"}


def check_zero_json(config: Config, ds: dict[str, Any]) -> None:
    """The offload devices of the merged JSON are the config's (the NVMe directory is a fact of the
    machine the run starts on: `check_offload_runs_here`)."""
    t = config.training
    zero = ds.get("zero_optimization") or {}
    ours = {"offload_optimizer": t.optimizer_offload, "offload_param": t.offload_param}
    for key, flag in _FLAGS.items():
        device = str((zero.get(key) or {}).get("device", "none"))
        if device != ours[key]:
            raise ZeroConfigError(
                f"the DeepSpeed JSON sets zero_optimization.{key}.device={device!r} but the flags give "
                f"{ours[key]!r}; give {flag} {device} (the flags decide the optimizer and the memory model) or "
                f"remove {key} from --deepspeed_config"
            )


def _check_nvme_path(path: str, key: str) -> None:
    if not os.path.isdir(path):
        raise ZeroConfigError(
            f"--offload-nvme-path {path}: not a directory ({key} to nvme swaps its tensors into files there); "
            f"give a directory on a local NVMe drive"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ZeroConfigError(f"--offload-nvme-path {path}: not writable; give a directory this user can write")


def check_offload_runs_here(config: Config) -> None:
    """DeepSpeed's ops that offload needs build on this machine, and the host holds what offload puts there
    (the memory model's prediction for this node's ranks); one line each, before any process group."""
    t = config.training
    for key, device in (("offload_optimizer", t.optimizer_offload), ("offload_param", t.offload_param)):
        if device == "nvme":
            _check_nvme_path(t.offload_nvme_path or "", key)
    if t.cpu_optimizer:
        _check_op(
            "CPUAdamBuilder",
            "--cpu-optimizer runs DeepSpeed's CPU Adam op (cpu_adam, compiled on first use)",
            "--cpu-optimizer",
        )
    offload = (("--offload-optimizer", t.optimizer_offload), ("--offload-param", t.offload_param))
    nvme = " and ".join(f"{f} nvme" for f, d in offload if d == "nvme")
    if nvme:
        _check_op(
            "AsyncIOBuilder",
            f"NVMe offload ({nvme}) swaps through DeepSpeed's async_io op (it needs libaio: apt install libaio-dev)",
            f"{nvme} (offload to cpu instead)",
        )
    needed = predicted_host_bytes(config)
    if needed:
        import psutil

        available = psutil.virtual_memory().available
        if needed > available:
            raise ZeroConfigError(
                f"offload needs {format_bytes(needed)} of host memory on this node (the memory model, for its "
                f"{_local_ranks(config)} rank(s)) but {format_bytes(available)} is available; offload to nvme (with "
                f"--zero-stage 3 and --offload-nvme-path) or spread the ranks over more nodes"
            )


def _check_op(builder: str, what: str, flags: str) -> None:
    from deepspeed.accelerator import get_accelerator

    op = get_accelerator().create_op_builder(builder)
    if op is None or not op.is_compatible(verbose=False):
        raise ZeroConfigError(f"{what}, which cannot be built on this machine; install what it needs or drop {flags}")


def _local_ranks(config: Config) -> int:
    world = config.parallel.world_size or config.parallel.model_parallel_size
    return min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def predicted_host_bytes(config: Config) -> float:
    """Host bytes that offload keeps on this node: the memory model's per-rank `host` of each stage, for the ranks
    the launcher puts here (ranks are placed pipeline-outermost; 0 without offload)."""
    from megatron_ds.estimate.memory_model import stage_memory
    from megatron_ds.estimate.run_layout import build_run_layout, memory_inputs, uses_measured_times
    from megatron_ds.training.machine import probe

    t = config.training
    if t.optimizer_offload == "none" and t.offload_param == "none":
        return 0.0
    machine = probe()
    # A split measured on this machine (`profile`) is not measured for this: the default split's parameters
    unmeasured = config.replace(parallel__pp_partition_method=None) if uses_measured_times(config) else config
    stages = stage_memory(memory_inputs(config, machine), build_run_layout(unmeasured, machine))
    par = config.parallel
    per_stage = par.data_parallel_size * par.tensor_model_parallel_size
    first = int(os.environ.get("RANK", "0")) // _local_ranks(config) * _local_ranks(config)
    ranks = range(first, first + _local_ranks(config))
    return sum(stages[min(r // per_stage, len(stages) - 1)].host for r in ranks)
