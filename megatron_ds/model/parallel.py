"""Tensor-parallel state queries that work whether or not megatron-core's state is initialised.

megatron-core is imported only by tensor-parallel runs (it is slow to import); when it has not
been imported, tensor parallelism cannot have been set up.
"""
from __future__ import annotations

import sys


def _state():
    ps = sys.modules.get("megatron.core.parallel_state")
    return ps if ps is not None and ps.model_parallel_is_initialized() else None


def tensor_parallel_rank() -> int:
    """This rank's tensor-parallel rank (0 when tensor parallelism is not set up)."""
    ps = _state()
    return 0 if ps is None else ps.get_tensor_model_parallel_rank()


def tensor_parallel_world_size() -> int:
    """Tensor-parallel ranks T (1 when tensor parallelism is not set up)."""
    ps = _state()
    return 1 if ps is None else ps.get_tensor_model_parallel_world_size()
