"""megatron-core's sequence-parallel code paths on CPU (gloo): what `install` changes, and why.

megatron-core 0.16.1 runs its sequence-parallel linears and mappings unmodified except for where it
allocates: `torch.cuda.current_device()` for the all-gather / reduce-scatter outputs and the
backward's reduce-scattered input gradient (`tensor_parallel/mappings.py`, `tensor_parallel/layers.py`),
and its global memory buffer (`parallel_state.get_global_memory_buffer()`, which holds the
all-gathered input of every sequence-parallel linear). On a CPU-only torch those calls raise. gloo
itself has every collective they use (`all_gather_into_tensor`, `reduce_scatter_tensor`).

`install()` (CPU only; a no-op on an accelerator) therefore:

* gives `megatron.core.tensor_parallel.mappings` and `.layers` a view of `torch` whose
  `cuda.current_device()` is the CPU, so their `torch.empty(..., device=torch.cuda.current_device())`
  allocates on the CPU; every other attribute is torch's own;
* replaces the global memory buffer with `CpuMemoryBuffer` (the same reuse rule, on the CPU);
* marks megatron-core's CUDA_DEVICE_MAX_CONNECTIONS warning as given (it is about CUDA streams).

Nothing of megatron-core's arithmetic or communication is replaced.
"""

from __future__ import annotations

import functools
import operator
import types
from typing import Any

import torch


class _CpuCuda:
    """`torch.cuda` with `current_device()` answering the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")


class _TorchOnCpu(types.ModuleType):
    """The `torch` module as megatron-core's mappings and layers see it on CPU."""

    cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class CpuMemoryBuffer:
    """megatron-core's `GlobalMemoryBuffer` on the CPU: one growing buffer per (name, dtype), views handed out."""

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(
        self, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None
    ) -> torch.Tensor:
        del mem_alloc_context
        required = functools.reduce(operator.mul, tensor_shape, 1)
        held = self.buffer.get((name, dtype))
        if held is None or held.numel() < required:
            held = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
        return held[:required].view(*tensor_shape)


def install() -> None:
    """Make megatron-core's sequence-parallel paths allocate on the CPU (see the module); idempotent."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers, mappings

    on_cpu = _TorchOnCpu("torch")
    mappings.torch = on_cpu
    layers.torch = on_cpu
    if not isinstance(parallel_state._GLOBAL_MEMORY_BUFFER, CpuMemoryBuffer):
        parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
    layers.linear_with_grad_accumulation_and_async_allreduce.warned = True
