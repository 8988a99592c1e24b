"""Common GPUs in one table: memory, compute capability and dense peak TFLOP/s. Pure: no torch.

Read by the planner (`--gpu NAME`: memory, compute capability, the step at peak) and by the
training loop's MFU (the peak of `torch.cuda.get_device_name()` in the run's precision). A device
is found by its planner name (case-insensitive; `find_named` also takes a unique prefix) or by a
device-name string such as `NVIDIA H100 80GB HBM3`, `NVIDIA A100-SXM4-80GB`, `Tesla V100-SXM2-32GB`
or a planner name (`find_device`: each row's regular expression, searched case-insensitively, the
first match in table order wins, so a variant's row precedes its family's).

Sources. Memory is the vendor's marketed capacity, treated as GiB; compute capabilities are
NVIDIA's (developer.nvidia.com/cuda-gpus). Peaks are NVIDIA's datasheet tensor-core peaks without
structured sparsity (the datasheets print twice these "with sparsity"); `fp32` is the plain FP32
peak, since torch runs fp32 matmuls without TF32 by default (`torch.backends.cuda.matmul.allow_tf32`
is False). A GPU without bf16 tensor cores (Volta, Turing) has no bf16 peak.

This table joins two earlier ones with different coverage, the planner's (memory, compute
capability) and the MFU peaks; a figure only one of them had is None in the other's columns
(`--gpu-memory-gb` or `--peak-tflops` give it), except the compute capability of a variant, which is
its family's (the same chip).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    """One GPU model."""

    name: str
    """The planner's `--gpu` name."""
    pattern: str
    """Regular expression searched in a device name (case-insensitive); the first match wins."""
    compute_capability: tuple[int, int]
    memory_gb: float | None
    """Marketed memory; None: not in the table (give `--gpu-memory-gb`)."""
    fp16: float | None
    """Dense peak TFLOP/s; None: not in the table (`--peak-tflops` gives it to the MFU)."""
    bf16: float | None
    fp32: float | None
    aliases: tuple[str, ...] = ()
    """Other `--gpu` names matched exactly (before any prefix match)."""

    def peak_tflops(self, precision: str) -> float | None:
        """Dense peak TFLOP/s in `precision` (`fp32`, `bf16`, `fp16`), or None."""
        return getattr(self, precision)


DEVICES: tuple[Device, ...] = (
    Device("P100-16GB", r"P100", (6, 0), 16, None, None, None),  # no peaks in the MFU table
    # V100S and V100 PCIe: peaks from the MFU table; memory None (the planner's table had neither row)
    Device("V100S", r"V100S", (7, 0), None, 130.0, None, 16.4),
    Device("V100-PCIe", r"V100.*PCIE", (7, 0), None, 112.0, None, 14.0),
    Device("V100-16GB", r"V100.*16GB", (7, 0), 16, 125.0, None, 15.7),  # SXM2
    Device("V100-32GB", r"V100", (7, 0), 32, 125.0, None, 15.7),  # SXM2
    Device("T4", r"\bT4\b", (7, 5), 16, 65.0, None, 8.1),
    Device("A10", r"\bA10\b", (8, 6), 24, 125.0, 125.0, 31.2),  # not A10G (a different part, no peaks here)
    Device("A30", r"\bA30\b", (8, 0), 24, 165.0, 165.0, 10.3),
    Device("A40", r"\bA40\b", (8, 6), 48, 149.7, 149.7, 37.4),
    Device("A100-40GB", r"A100.*40GB", (8, 0), 40, 312.0, 312.0, 19.5),
    Device("A100-80GB", r"A100", (8, 0), 80, 312.0, 312.0, 19.5),  # SXM or PCIe: the same peaks
    Device("RTX-3090", r"RTX[- ]3090", (8, 6), 24, None, None, None),  # the RTX rows: no peaks in the MFU table
    Device("RTX-A6000", r"RTX[- ]A6000", (8, 6), 48, None, None, None),
    Device("RTX-4090", r"RTX[- ]4090", (8, 9), 24, None, None, None),
    Device("L4", r"\bL4\b", (8, 9), 24, 121.0, 121.0, 30.3),
    Device("L40S", r"\bL40S\b", (8, 9), 48, 362.0, 362.0, 91.6),
    # H100 PCIe and NVL: peaks from the MFU table; memory None (the planner's table had neither row)
    Device("H100-PCIe", r"H100.*PCIE", (9, 0), None, 756.0, 756.0, 51.2),
    Device("H100-NVL", r"H100.*NVL", (9, 0), None, 835.0, 835.0, 60.0),
    # SXM; `--gpu H100` keeps naming it, as it did before the PCIe and NVL rows joined
    Device("H100-80GB", r"H100", (9, 0), 80, 989.4, 989.4, 66.9, aliases=("H100",)),
    Device("H200", r"H200", (9, 0), 141, 989.4, 989.4, 66.9),
)


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(" ", "-")


def find_named(name: str) -> tuple[Device, ...]:
    """The device whose planner name or alias is `name` (case-insensitive), else every device whose
    name starts with it: one device, several (ambiguous) or none."""
    key = _key(name)
    exact = tuple(d for d in DEVICES if key in (_key(n) for n in (d.name, *d.aliases)))
    return exact or tuple(d for d in DEVICES if _key(d.name).startswith(key))


def find_device(device_name: str) -> Device | None:
    """The device a name such as `torch.cuda.get_device_name()` returns (or a planner name) is, or None."""
    for device in DEVICES:
        if re.search(device.pattern, device_name, re.IGNORECASE):
            return device
    return None


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of one device of this name in `precision` (`fp32`, `bf16`, `fp16`), or None."""
    device = find_device(device_name)
    return None if device is None else device.peak_tflops(precision)


def architecture_of(cc: tuple[int, int]) -> str:
    """NVIDIA's architecture name for a compute capability."""
    major, minor = cc
    if major >= 10:
        return "Blackwell or newer"
    names = {6: "Pascal", 7: "Turing" if minor >= 5 else "Volta", 9: "Hopper"}
    if major == 8:
        return "Ada Lovelace" if minor >= 9 else "Ampere"
    return names.get(major, "pre-Pascal")
