"""Planning without GPUs: the analytic memory model and the DeepSpeed configuration advisor.

    megatron_ds.plan.memory_model   MemoryInputs, spec_memory, stage_memory, format_bytes
    megatron_ds.plan.model_states   bytes per parameter by precision/ZeRO; DeepSpeed's estimator formulas
    megatron_ds.plan.activations    activation bytes per layer (Korthikanti et al. 2022)
    megatron_ds.pipeline.balance    memory_balanced_layout (method "memory")
    python -m megatron_ds.plan      the advisor (see megatron_ds.plan.cli)

Importing this package does not import torch or deepspeed.
"""

from megatron_ds.plan.memory_model import (
    MemoryInputs,
    SpecMemory,
    StageMemory,
    format_bytes,
    spec_memory,
    stage_memory,
    stage_memory_for,
)

__all__ = [
    "MemoryInputs",
    "SpecMemory",
    "StageMemory",
    "format_bytes",
    "spec_memory",
    "stage_memory",
    "stage_memory_for",
]
