"""The planner's step times in seconds: one candidate configuration priced by the step-time model
(`estimate/step_time.py`) on the `--gpu`'s kernels and links, for what pretrain_gpt.py runs
(`estimate/run_features.deepspeed_features`).

A GPU the table does not describe (given by `--gpu-memory-gb`) is priced at `UNKNOWN_PEAK_TFLOPS` with
A100-like bandwidths; the report says its seconds only rank configurations.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megatron_ds.estimate.communication import Links
from megatron_ds.estimate.devices import Device, find_device
from megatron_ds.estimate.efficiency import DEFAULT_MATMUL_FRACTION, Kernels
from megatron_ds.estimate.model_states import PRECISION_BYTES
from megatron_ds.estimate.run_features import RunFeatures, deepspeed_features
from megatron_ds.estimate.step_inputs import StepInputs, StepTime
from megatron_ds.estimate.step_time import predict_step
from megatron_ds.files import read_json
from megatron_ds.plan.hardware import PlanError

UNKNOWN_PEAK_TFLOPS = 100.0
UNKNOWN_BANDWIDTH_GBS = 1555.0


@dataclass(frozen=True)
class Hardware:
    """The device and links every candidate is priced on."""

    kernels: Kernels
    links: Links
    known: bool
    """The GPU is in the table with its peak and bandwidth (else the seconds only rank configurations)."""

    @property
    def source(self) -> str:
        return f"{self.kernels.name}: {self.kernels.source}; {self.links.source}"


def _unknown_kernels(name: str) -> Kernels:
    frac = DEFAULT_MATMUL_FRACTION
    source = f"not in the table: assumed {UNKNOWN_PEAK_TFLOPS:g} TFLOP/s peak, {UNKNOWN_BANDWIDTH_GBS:g} GB/s"
    return Kernels(
        name, UNKNOWN_PEAK_TFLOPS * 1e12, frac, UNKNOWN_BANDWIDTH_GBS * 1e9, frac * 0.7, frac * 0.6, None, source=source
    )


@functools.lru_cache(maxsize=32)
def hardware(gpu_name: str | None, precision: str, gpus_per_node: int, kernel_profile: str | None = None) -> Hardware:
    """The kernels and links of `gpu_name` in `precision` (`--kernel-profile FILE` replaces the kernel figures)."""
    device: Device | None = find_device(gpu_name) if gpu_name else None
    kernels = Kernels.for_device(device, precision) if device else None
    known = kernels is not None
    if kernels is None:
        kernels = _unknown_kernels(gpu_name or "unknown GPU")
    if kernel_profile:
        kernels = kernels.measured(read_kernel_profile(kernel_profile))
    return Hardware(kernels, Links.for_device(device, gpus_per_node), known)


def read_kernel_profile(path: str) -> dict:
    """A measured profile (`benchmarks/kernel_profile.py --write FILE`): a JSON object of positive numbers."""
    keys = ("matmul_tflops", "memory_gbs", "attention_forward_tflops", "attention_backward_tflops")
    data = read_json(
        path,
        "--kernel-profile",
        PlanError,
        ("give a file kernel_profile.py wrote", "re-measure with benchmarks/kernel_profile.py"),
        at_line=False,
    )
    if not isinstance(data, dict) or not any(k in data for k in keys):
        raise PlanError(
            f"--kernel-profile {path}: none of {', '.join(keys)}; re-measure with benchmarks/kernel_profile.py"
        )
    for k in keys:
        if k in data and not (isinstance(data[k], (int, float)) and data[k] > 0):
            raise PlanError(f"--kernel-profile {path}: {k} {data[k]!r} is not a positive number; re-measure")
    return data


def features(zero_stage: int, precision: str, sequence_parallel: bool = False) -> RunFeatures:
    return deepspeed_features(zero_stage, PRECISION_BYTES[precision], sequence_parallel=sequence_parallel)


def step_time(inputs: StepInputs, hw: Hardware, run: RunFeatures | None = None) -> StepTime:
    """The candidate's step on `hw`, as pretrain_gpt.py runs it unless `run` says otherwise."""
    return predict_step(inputs, hw.kernels, hw.links, run or features(inputs.zero_stage, inputs.precision))
