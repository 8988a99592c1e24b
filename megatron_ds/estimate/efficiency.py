"""How fast each kind of kernel runs on one device, in seconds: matmuls by shape, flash attention, and
memory-bound work by bytes moved. Pure arithmetic over stated constants; no torch.

A `Kernels` is one device in one precision. Its figures come from the GPU table (`estimate/devices.py`)
and the shared constants below, or from a measured profile (`Kernels.measured`, written by
`benchmarks/kernel_profile.py` on the machine at hand), which replaces them.

Model (each term a kind of kernel the step runs):
  matmul (m x k) @ (k x n), `batch` of them: the larger of its compute time, 2mnk / (peak x the device's
      measured matmul ceiling x wave efficiency), and its memory time (reading both operands and
      writing the result at the achievable bandwidth). Wave efficiency: the output is cut into
      TILE x TILE tiles, one per streaming multiprocessor at a time; a last partial wave leaves the rest
      idle (NVIDIA, "Matrix Multiplication Background User's Guide", wave quantization). A matmul of
      fewer tiles than processors is split along k (split-K) while k allows. A device with a measured
      table of rates by shape (`estimate/matmul_table.py`: the H100 SXM and H200 in 16 bits) takes its
      compute time from the table instead, `batch` products as `batch` times one.
  flash attention: its FLOPs (the causal triangle it computes) at a stated share of the peak, forward
      and backward apart (`ATTENTION_FRACTION`).
  memory-bound kernels (norms, activations, softmax, dropout, residual adds, the loss, the optimizer
      step): bytes read and written at `MEMORY_FRACTION` of the datasheet bandwidth.
Nothing here is fitted to a training run: the shares are the sources' figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megatron_ds.estimate.devices import Device
from megatron_ds.estimate.matmul_table import TABLES, MatmulTable

TILE = 128
"""Output tile edge of one thread block (cuBLAS's common 128 x 128 tiles on Ampere and Hopper)."""
SPLIT_K_MIN = 512
"""Smallest k slice a split-K matmul hands one processor (a stated assumption)."""
MEMORY_FRACTION = 0.8
"""Share of the datasheet memory bandwidth memory-bound kernels reach (an assumption: streaming kernels
reach 80-90% on HBM; IST-DASLab's Marlin README notes ECC alone costs 10-15% of the spec)."""
DEFAULT_MATMUL_FRACTION = 0.8
"""The matmul ceiling of a GPU without a measured figure in the table: an assumption, near the measured
NVIDIA rows (A100 SXM 0.87, H100 SXM 0.80; stas00/ml-engineering's MAMF table). Reports name it."""
ATTENTION_FRACTION = {
    (8, "forward"): 0.62,
    (8, "backward"): 0.52,
    (9, "forward"): 0.62,
    (9, "backward"): 0.47,
}
"""Flash attention's share of the dense peak by compute-capability major and pass, causal, head size
128, sequences of 2k-4k, as read off the papers' plots: Ampere from Dao 2023 ("FlashAttention-2", arXiv
2307.08691, A100 figures: about 190-200 TFLOP/s forward and 160-170 backward of 312), Hopper from Shah et
al. 2024 ("FlashAttention-3", arXiv 2407.08608, H100 BF16: about 610 forward and 470 backward of 989).
Other devices: their matmul ceiling times Ampere's ratio of attention to matmul (an assumption)."""
AMPERE_MATMUL_FRACTION = 271.2 / 312.0
"""The A100 SXM's measured matmul ceiling over its peak (the MAMF table)."""


@dataclass(frozen=True)
class Kernels:
    """Achievable rates of one device in one precision."""

    name: str
    peak_flops: float
    """Dense peak FLOP/s in this precision."""
    matmul_fraction: float
    """Share of the peak a large well-shaped matmul reaches."""
    memory_bandwidth: float
    """Bytes per second of the datasheet."""
    attention_forward: float
    """Share of the peak flash attention's forward reaches."""
    attention_backward: float
    compute_units: int | None = None
    """Processors the tiles of a matmul spread over (None: no wave quantization)."""
    memory_fraction: float = MEMORY_FRACTION
    source: str = ""
    """Where the matmul ceiling comes from (reports print it)."""
    shape_rates: MatmulTable | None = None
    """Measured matmul rates by shape; None: the ceiling times the wave efficiency."""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "matmul_fraction", "memory_bandwidth", "attention_forward", "attention_backward"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def for_device(cls, device: Device, precision: str) -> Kernels | None:
        """The device's kernels in `precision`, or None when the table lacks its peak or memory bandwidth."""
        peak = device.peak_tflops(precision)
        if peak is None or device.memory_bandwidth is None:
            return None
        measured = device.matmul_tflops is not None and precision in ("bf16", "fp16")
        fraction = device.matmul_tflops / peak if measured else DEFAULT_MATMUL_FRACTION
        major = device.compute_capability[0] if device.compute_capability else 0
        forward, backward = (
            ATTENTION_FRACTION.get((major, p), fraction * ATTENTION_FRACTION[(8, p)] / AMPERE_MATMUL_FRACTION)
            for p in ("forward", "backward")
        )
        source = (
            f"matmul ceiling {device.matmul_tflops:g} TFLOP/s (the MAMF table)"
            if measured
            else f"assumed matmul ceiling {DEFAULT_MATMUL_FRACTION:.0%} of the peak (no measured figure)"
        )
        table = TABLES[device.matmul_table] if device.matmul_table and precision in ("bf16", "fp16") else None
        if table is not None:
            source = f"matmul rates by shape from {table.source}"
        return cls(
            device.name,
            peak * 1e12,
            fraction,
            device.memory_bandwidth * 1e9,
            min(forward, fraction),
            min(backward, fraction),
            device.compute_units,
            source=source,
            shape_rates=table,
        )

    @classmethod
    def from_profile(cls, profile: dict) -> Kernels:
        """A device known only by a measured profile (a CPU: `benchmarks/kernel_profile.py`): its matmul rate
        is its peak; attention and memory rates as measured."""
        peak = profile["matmul_tflops"] * 1e12
        return cls(
            profile.get("name", "profiled device"),
            peak,
            1.0,
            profile["memory_gbs"] * 1e9,
            profile["attention_forward_tflops"] * 1e12 / peak,
            profile["attention_backward_tflops"] * 1e12 / peak,
            None,
            memory_fraction=1.0,
            source=f"measured profile {profile.get('name', '')}".strip(),
        )

    def measured(self, profile: dict) -> Kernels:
        """These kernels with a measured profile's figures (`matmul_tflops`, `memory_gbs`, `attention_*_tflops`)."""
        changes: dict = {}
        if "matmul_tflops" in profile:  # the measured rate replaces the table too
            changes.update(matmul_fraction=profile["matmul_tflops"] * 1e12 / self.peak_flops, shape_rates=None)
        if "memory_gbs" in profile:
            changes.update(memory_bandwidth=profile["memory_gbs"] * 1e9, memory_fraction=1.0)
        for key, field in (
            ("attention_forward_tflops", "attention_forward"),
            ("attention_backward_tflops", "attention_backward"),
        ):
            if key in profile:
                changes[field] = profile[key] * 1e12 / self.peak_flops
        return replace(self, **changes, source=f"measured profile {profile.get('name', '')}".strip())

    def wave_efficiency(self, m: int, n: int, k: int, batch: int = 1) -> float:
        """Busy share of the processors over the waves of output tiles (split-K when there are too few)."""
        units = self.compute_units
        if not units:
            return 1.0
        tiles = math.ceil(m / TILE) * math.ceil(n / TILE) * batch
        if tiles < units:
            split = max(1, min(units // tiles, k // SPLIT_K_MIN))
            return min(1.0, tiles * split / units)
        waves = tiles / units
        return waves / math.ceil(waves)

    def matmul(self, m: int, n: int, k: int, batch: int = 1, element_bytes: int = 2) -> float:
        """Seconds of `batch` (m x k) @ (k x n) products."""
        if min(m, n, k, batch) <= 0:
            return 0.0
        flops = 2.0 * m * n * k * batch
        if self.shape_rates is not None:
            compute = flops / self.shape_rates.flops_per_second(m, n, k)
        else:
            compute = flops / (self.peak_flops * self.matmul_fraction * self.wave_efficiency(m, n, k, batch))
        traffic = element_bytes * batch * (m * k + k * n + m * n)
        return max(compute, self.memory(traffic))

    def memory(self, nbytes: float) -> float:
        """Seconds to read and write `nbytes` in memory-bound kernels."""
        return nbytes / (self.memory_bandwidth * self.memory_fraction)

    def attention(self, flops: float, backward: bool = False) -> float:
        """Seconds of a flash-attention pass of `flops` (its causal FLOPs)."""
        return flops / (self.peak_flops * (self.attention_backward if backward else self.attention_forward))
