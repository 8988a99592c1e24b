"""What this process runs on, as the estimates need it: handed down by the runtime layer
(`megatron_ds.training.machine.probe`), so the estimates themselves import no torch."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ds.config import Config
from megatron_ds.errors import ConfigError


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


def check_runs_on(config: Config, machine: Machine) -> None:
    """Options this device cannot run, as one-line errors (before any process group exists)."""
    if config.training.precision == "fp16" and machine.device == "cpu":
        raise ConfigError("--fp16 needs a GPU (DeepSpeed's CPU accelerator has no fp16); use --bf16 or fp32")
