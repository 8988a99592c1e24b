"""What this process runs on, as the estimates need it: handed down by the runtime layer
(`megatron_ds.training.machine.probe`), so the estimates themselves import no torch."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.config import Config
from megatron_ds.errors import ConfigError
from megatron_ds.estimate.devices import DEVICES, find_named
from megatron_ds.units import format_bytes


@dataclass(frozen=True)
class Machine:
    """One rank's device."""

    device: str = "cpu"
    """`cuda` when a GPU is visible, else `cpu` (the kernels the memory model assumes follow it)."""
    device_memory: float | None = None
    """Bytes of one device (the default `--pp-memory-limit`); None on CPU, where there is none."""
    device_name: str | None = None
    """What `torch.cuda.get_device_name()` returns (the peak-FLOP/s table's key), None on CPU."""


CPU = Machine()
"""A CPU process: the math attention kernel's memory, no device memory to default a limit to."""
GIB = 2**30


def named(name: str) -> Machine:
    """The device `--pp-device NAME` names: `cpu`, or a GPU of `estimate.devices` by its planner name
    (case-insensitive, a unique prefix too, as the planner's `--gpu`), with its memory as the limit."""
    if name.lower() == "cpu":
        return CPU
    found = find_named(name)
    if len(found) != 1:
        names = ", ".join(d.name for d in (found or DEVICES))
        what = "is ambiguous" if found else "is not a GPU of estimate/devices.py"
        raise ConfigError(f"--pp-device {name} {what}; give cpu or one of {names}")
    (gpu,) = found
    memory = None if gpu.memory_gb is None else float(gpu.memory_gb) * GIB
    return Machine(device="cuda", device_memory=memory, device_name=gpu.name)


def for_layout(config: Config, local: Machine) -> Machine:
    """The device the layout and its memory prediction are for: `--pp-device`, else `local` (this process's)."""
    name = config.parallel.pp_device
    return local if name is None else named(name)


def describe(config: Config, machine: Machine) -> str:
    """Which device a memory prediction is for, as `--print-layout` and the trainer print it."""
    size = "" if machine.device_memory is None else f", {format_bytes(machine.device_memory)} each"
    if config.parallel.pp_device is not None:
        what = "CPU processes" if machine.device == "cpu" else machine.device_name
        return f"memory predicted for --pp-device {config.parallel.pp_device}: {what}{size}"
    if machine.device == "cuda":
        return f"memory predicted for this machine's GPU, {machine.device_name}{size}"
    return (
        "memory predicted for CPU processes (this machine has no GPU); give --pp-device NAME (e.g. H100, "
        "A100-80GB: estimate/devices.py) to predict for the GPUs the run will use"
    )


def check_runs_on(config: Config, machine: Machine) -> None:
    """Options this device cannot run, as one-line errors (before any process group exists)."""
    if config.training.precision == "fp16" and machine.device == "cpu":
        raise ConfigError("--fp16 needs a GPU (DeepSpeed's CPU accelerator has no fp16); use --bf16 or fp32")
    if config.parallel.distributed_backend == "nccl" and machine.device == "cpu":
        raise ConfigError(
            "--distributed-backend nccl needs GPUs (none is visible here); use --distributed-backend gloo, or drop "
            "the flag (gloo by default on CPU)"
        )
