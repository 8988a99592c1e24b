"""Estimates from the config and a layout alone (pure arithmetic, no torch, no GPUs).

    megatron_ds.estimate.memory_model   MemoryInputs, spec_memory, stage_memory, format_bytes
    megatron_ds.estimate.model_states   bytes per parameter by precision/ZeRO; DeepSpeed's estimator formulas
    megatron_ds.estimate.activations    activation bytes per layer (Korthikanti et al. 2022)

Used by the memory partition method (`--pp-partition-method memory`), by the predicted-memory
table under `--print-layout`, and by the planner (`megatron_ds.plan`).
"""

from megatron_ds.estimate.memory_model import (
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
