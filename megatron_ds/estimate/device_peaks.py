"""Peak dense TFLOP/s of common GPUs, for MFU (model FLOPs utilisation) and the planner's step bounds.

One table, looked up by device name (what `torch.cuda.get_device_name()` returns, e.g. `NVIDIA
H100 80GB HBM3`, `NVIDIA A100-SXM4-80GB`, `Tesla V100-SXM2-32GB`, or the planner's `--gpu` names
such as `A100-80GB`) and the run's precision. Values are NVIDIA's datasheet tensor-core peaks
without structured sparsity (the datasheets print twice these "with sparsity"); `fp32` is the
plain FP32 peak, since torch runs fp32 matmuls without TF32 by default
(`torch.backends.cuda.matmul.allow_tf32` is False). A GPU without bf16 tensor cores (Volta,
Turing) has no bf16 peak. `--peak-tflops` overrides the table; an unknown device gives no MFU.
Pure: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Peak:
    pattern: str
    """Regular expression searched in the device name (case-insensitive); the first match wins."""
    fp16: float
    bf16: float | None
    fp32: float


PEAKS: tuple[Peak, ...] = (
    Peak(r"H100.*PCIE", 756.0, 756.0, 51.2),
    Peak(r"H100.*NVL", 835.0, 835.0, 60.0),
    Peak(r"H100", 989.4, 989.4, 66.9),  # SXM
    Peak(r"H200", 989.4, 989.4, 66.9),
    Peak(r"A100", 312.0, 312.0, 19.5),
    Peak(r"\bA10\b", 125.0, 125.0, 31.2),
    Peak(r"\bA30\b", 165.0, 165.0, 10.3),
    Peak(r"\bA40\b", 149.7, 149.7, 37.4),
    Peak(r"\bL40S\b", 362.0, 362.0, 91.6),
    Peak(r"\bL4\b", 121.0, 121.0, 30.3),
    Peak(r"V100S", 130.0, None, 16.4),
    Peak(r"V100.*PCIE", 112.0, None, 14.0),
    Peak(r"V100", 125.0, None, 15.7),  # SXM2
    Peak(r"\bT4\b", 65.0, None, 8.1),
)


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of one device of this name in `precision` (`fp32`, `bf16`, `fp16`), or None."""
    for peak in PEAKS:
        if re.search(peak.pattern, device_name, re.IGNORECASE):
            return getattr(peak, precision)
    return None
