"""Common GPUs in one table: memory, compute capability, dense peak TFLOP/s, the memory, GPU-to-GPU, host
and network bandwidths and the measured matmul ceiling the step-time model reads. Pure: no torch.

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
    compute_capability: tuple[int, int] | None
    """NVIDIA's compute capability; None for a GPU of another vendor (AMD's MI300X)."""
    memory_gb: float | None
    """Marketed memory; None: not in the table (give `--gpu-memory-gb`)."""
    fp16: float | None
    """Dense peak TFLOP/s; None: not in the table (`--peak-tflops` gives it to the MFU)."""
    bf16: float | None
    fp32: float | None
    aliases: tuple[str, ...] = ()
    """Other `--gpu` names matched exactly (before any prefix match)."""
    memory_bandwidth: float | None = None
    """Datasheet memory bandwidth, GB/s (10^9 bytes per second)."""
    scale_up: float | None = None
    """Datasheet GPU-to-GPU bandwidth inside a node (NVLink; AMD's Infinity Fabric), GB/s in both directions
    together as the datasheets print it; None: no such link (PCIe only)."""
    pcie: float | None = None
    """Datasheet host-link bandwidth, GB/s in both directions together (PCIe Gen3 x16 32, Gen4 64, Gen5 128)."""
    network: float | None = None
    """Scale-out bandwidth per GPU of the vendor's reference system, Gb/s one way (DGX A100: one 200 Gb/s HDR
    InfiniBand adapter per GPU; DGX H100/H200: one 400 Gb/s NDR); None: no reference system."""
    compute_units: int | None = None
    """Streaming multiprocessors (AMD: compute units), from the architecture whitepapers (wave quantization)."""
    matmul_tflops: float | None = None
    """Measured maximum achievable bf16 matmul TFLOP/s (MAMF: the best of a brute-force search over shapes,
    stas00/ml-engineering `compute/accelerator/README.md`, "Maximum Achievable Matmul FLOPS comparison
    table"); None: not measured there."""
    matmul_table: str | None = None
    """A measured table of matmul rates by shape (`estimate/matmul_table.TABLES`) that prices its 16-bit matmuls
    instead of the ceiling and wave quantization; None: no such table."""
    vendor: str = "nvidia"

    def peak_tflops(self, precision: str) -> float | None:
        """Dense peak TFLOP/s in `precision` (`fp32`, `bf16`, `fp16`), or None."""
        return getattr(self, precision)


_V100 = {"memory_bandwidth": 900.0, "scale_up": 300.0, "pcie": 32.0, "network": 50.0, "compute_units": 80}
_A100 = {"scale_up": 600.0, "pcie": 64.0, "network": 200.0, "compute_units": 108, "matmul_tflops": 271.2}
_HOPPER_SXM = {
    "scale_up": 900.0,
    "pcie": 128.0,
    "network": 400.0,
    "compute_units": 132,
    "matmul_tflops": 794.5,
    "matmul_table": "sm90-bf16",  # OpenXLA's sm_90 table: an SXM-class part (estimate/matmul_table.py)
}
# Bandwidth sources (vendor datasheets): V100 (volta-v100-datasheet: SXM2 900 GB/s, NVLink 300 GB/s, PCIe
# 32 GB/s; V100S 1134 GB/s); T4 (320 GB/s, PCIe Gen3); A10 (600 GB/s), A30 (933 GB/s, NVLink 200 GB/s), A40
# (696 GB/s, NVLink 112.5 GB/s) datasheets; A100 (nvidia-a100-datasheet: 40GB 1555 GB/s, 80GB SXM 2039 GB/s,
# 80GB PCIe 1935 GB/s, NVLink 600 GB/s, PCIe Gen4 64 GB/s); L4 (300 GB/s), L40S (864 GB/s, PCIe Gen4, no
# NVLink) datasheets; H100 (h100-datasheet: SXM 3.35 TB/s and NVLink 900 GB/s, PCIe 2 TB/s, NVL 3.9 TB/s,
# both NVLink bridges 600 GB/s, PCIe Gen5 128 GB/s); H200 (h200-datasheet: 4.8 TB/s, NVLink 900 GB/s, PCIe
# Gen5 128 GB/s); MI300X (AMD Instinct MI300X data sheet: 192 GB HBM3 at 5.3 TB/s, dense FP16/BF16 1307.4
# TFLOP/s, FP32 163.4, 304 compute units, 7 Infinity Fabric links of 128 GB/s = 896 GB/s, PCIe Gen5 x16);
# RTX 3090 and RTX A6000 (NVIDIA Ampere GA102 GPU Architecture whitepaper v2.0, Appendices A and C: 71 and
# 154.8 dense FP16/BF16 tensor TFLOP/s with FP32 accumulate, FP32 35.6 and 38.7, 936 and 768 GB/s, 82 and 84
# SMs, the A6000's NVLink bridge 112.5 GB/s); RTX 4090 (NVIDIA Ada GPU Architecture whitepaper, Appendix A:
# 165.2 dense FP16/BF16 with FP32 accumulate, FP32 82.6, 1008 GB/s, 128 SMs); all PCIe Gen4 x16.
# Networks: the DGX-1/DGX-2 (4 or 8 x 100 Gb/s EDR for 8 or 16 V100s), DGX A100 (8 x 200 Gb/s) and DGX
# H100/H200 (8 x 400 Gb/s) datasheets. Compute units: the Volta, Turing, Ampere, Ada and Hopper whitepapers.
# A row that covers two boards (A100-80GB: SXM and PCIe) keeps the SXM figures.
DEVICES: tuple[Device, ...] = (
    Device("P100-16GB", r"P100", (6, 0), 16, None, None, None),  # no peaks in the MFU table
    # V100S and V100 PCIe: peaks from the MFU table; the V100S is 32 GB (its datasheet), the V100 PCIe 16 or
    # 32 GB, so None (`--gpu-memory-gb` gives it)
    Device("V100S", r"V100S", (7, 0), 32, 130.0, None, 16.4, memory_bandwidth=1134.0, pcie=32.0, compute_units=80),
    Device("V100-PCIe", r"V100.*PCIE", (7, 0), None, 112.0, None, 14.0, memory_bandwidth=900.0, pcie=32.0),
    Device("V100-16GB", r"V100.*16GB", (7, 0), 16, 125.0, None, 15.7, **_V100),  # SXM2
    Device("V100-32GB", r"V100", (7, 0), 32, 125.0, None, 15.7, **_V100),  # SXM2
    Device("T4", r"\bT4\b", (7, 5), 16, 65.0, None, 8.1, memory_bandwidth=320.0, pcie=32.0, compute_units=40),
    # not A10G (a different part, no peaks here)
    Device("A10", r"\bA10\b", (8, 6), 24, 125.0, 125.0, 31.2, memory_bandwidth=600.0, pcie=64.0, compute_units=72),
    Device("A30", r"\bA30\b", (8, 0), 24, 165.0, 165.0, 10.3, memory_bandwidth=933.0, scale_up=200.0, pcie=64.0),
    Device("A40", r"\bA40\b", (8, 6), 48, 149.7, 149.7, 37.4, memory_bandwidth=696.0, scale_up=112.5, pcie=64.0),
    Device("A100-40GB", r"A100.*40GB", (8, 0), 40, 312.0, 312.0, 19.5, memory_bandwidth=1555.0, **_A100),
    # SXM or PCIe: the same peaks
    Device("A100-80GB", r"A100", (8, 0), 80, 312.0, 312.0, 19.5, memory_bandwidth=2039.0, **_A100),
    # The RTX rows: 16-bit peaks with FP32 accumulation (what torch's cuBLAS matmuls use; GeForce cards
    # run FP16 accumulation at twice the rate, which torch does not use), from the whitepapers below.
    Device(
        "RTX-3090", r"RTX[- ]3090", (8, 6), 24, 71.0, 71.0, 35.6, memory_bandwidth=936.0, pcie=64.0, compute_units=82
    ),
    Device(
        "RTX-A6000",
        r"RTX[- ]A6000",
        (8, 6),
        48,
        154.8,
        154.8,
        38.7,
        memory_bandwidth=768.0,
        scale_up=112.5,
        pcie=64.0,
        compute_units=84,
    ),
    Device(
        "RTX-4090",
        r"RTX[- ]4090",
        (8, 9),
        24,
        165.2,
        165.2,
        82.6,
        memory_bandwidth=1008.0,
        pcie=64.0,
        compute_units=128,
    ),
    Device("L4", r"\bL4\b", (8, 9), 24, 121.0, 121.0, 30.3, memory_bandwidth=300.0, pcie=64.0, compute_units=58),
    Device("L40S", r"\bL40S\b", (8, 9), 48, 362.0, 362.0, 91.6, memory_bandwidth=864.0, pcie=64.0, compute_units=142),
    # H100 PCIe and NVL: peaks from the MFU table; memory from the H100 datasheet (PCIe 80 GB, NVL 94 GB)
    Device(
        "H100-PCIe",
        r"H100.*PCIE",
        (9, 0),
        80,
        756.0,
        756.0,
        51.2,
        memory_bandwidth=2000.0,
        scale_up=600.0,
        pcie=128.0,
        compute_units=114,
    ),
    Device(
        "H100-NVL", r"H100.*NVL", (9, 0), 94, 835.0, 835.0, 60.0, memory_bandwidth=3900.0, scale_up=600.0, pcie=128.0
    ),
    # SXM; `--gpu H100` keeps naming it, as it did before the PCIe and NVL rows joined
    Device(
        "H100-80GB", r"H100", (9, 0), 80, 989.4, 989.4, 66.9, aliases=("H100",), memory_bandwidth=3350.0, **_HOPPER_SXM
    ),
    # the MAMF table's H100 SXM row notes "H200 is the same"
    Device("H200", r"H200", (9, 0), 141, 989.4, 989.4, 66.9, memory_bandwidth=4800.0, **_HOPPER_SXM),
    # MAMF: 668.4 TFLOP/s (torch 2.5.1, ROCm 6.3, TunableOp on); no reference system's network here
    Device(
        "MI300X",
        r"MI300X",
        None,
        192,
        1307.4,
        1307.4,
        163.4,
        memory_bandwidth=5300.0,
        scale_up=896.0,
        pcie=128.0,
        compute_units=304,
        matmul_tflops=668.4,
        vendor="amd",
    ),
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


def architecture_of(cc: tuple[int, int] | None) -> str:
    """NVIDIA's architecture name for a compute capability (None: not an NVIDIA GPU)."""
    if cc is None:
        return "not NVIDIA"
    major, minor = cc
    if major >= 10:
        return "Blackwell or newer"
    names = {6: "Pascal", 7: "Turing" if minor >= 5 else "Volta", 9: "Hopper"}
    if major == 8:
        return "Ada Lovelace" if minor >= 9 else "Ampere"
    return names.get(major, "pre-Pascal")
