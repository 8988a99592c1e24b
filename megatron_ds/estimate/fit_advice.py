"""What would make a run fit when no split of its layers does: the memory model asked again with
more pipeline stages, with activation recomputation, and with ZeRO-1. Pure: no torch.

Used by `--pp-partition-method fastest` / `profile` (`run_layout.build_run_layout`) to finish its
one-line error.
"""

from __future__ import annotations

import dataclasses

from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.memory_model import stage_memory_for
from megatron_ds.pipeline.balance import minimax_split
from megatron_ds.units import format_bytes


def least_memory(inputs: MemoryInputs, num_stages: int) -> float:
    """The smallest largest-stage memory any split of the layers over `num_stages` needs (exact)."""
    n = inputs.model.num_layers
    return minimax_split(n, num_stages, lambda s, k: stage_memory_for(inputs, s, num_stages, k).total)[1]


def fit_advice(inputs: MemoryInputs, num_stages: int, limit: float) -> str:
    """`it would fit with ...` naming the smallest larger P, recomputation, ZeRO-1 (those that fit),
    each with its least largest stage; or what else to try when none does."""
    found = []
    max_stages = inputs.model.num_layers + 2
    for p in range(num_stages + 1, max_stages + 1):  # the same data parallelism, more stages (ranks)
        need = least_memory(inputs, p)
        if need <= limit:
            found.append(f"--pipeline-model-parallel-size {p} ({format_bytes(need)} on its largest stage)")
            break
    if not inputs.checkpoint_activations:
        need = least_memory(dataclasses.replace(inputs, checkpoint_activations=True), num_stages)
        if need <= limit:
            found.append(f"--checkpoint-activations ({format_bytes(need)})")
    if inputs.zero_stage == 0 and inputs.data_parallel_size > 1:
        need = least_memory(dataclasses.replace(inputs, zero_stage=1), num_stages)
        if need <= limit:
            found.append(f"--zero-stage 1 ({format_bytes(need)})")
    if found:
        return "it would fit with " + ", or ".join(found)
    return (
        f"no larger --pipeline-model-parallel-size (up to {max_stages}), recomputation or ZeRO-1 makes it fit; "
        f"lower --micro-batch-size or raise --pp-memory-limit"
    )
