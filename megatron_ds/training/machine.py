"""The facts about this process's device that the estimates and checks need, read with torch.

`probe()` is the one place that asks torch what the device is; the pure layers receive the
answer as an `estimate.machine.Machine` (whose `check_runs_on` refuses what the device cannot run).
"""

from __future__ import annotations

import torch

from megatron_ds.config import Config
from megatron_ds.estimate.machine import CPU, Machine, for_layout


def probe() -> Machine:
    """This process's device: the current GPU when one is visible, else the CPU."""
    if not torch.cuda.is_available():
        return CPU
    index = torch.cuda.current_device()
    return Machine(
        device="cuda",
        device_memory=float(torch.cuda.get_device_properties(index).total_memory),
        device_name=torch.cuda.get_device_name(index),
    )


def layout_machine(config: Config) -> Machine:
    """The device the layout is resolved for: `--pp-device`, else this process's (`probe`)."""
    return for_layout(config, probe())
