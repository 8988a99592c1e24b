"""The peak of the activations one training step keeps for backward (`ActivationPeak`), measured on the
tensors themselves: what autograd saves (`torch.autograd.graph.saved_tensors_hooks`) and what DeepSpeed's
activation checkpointing keeps for its recompute outside that mechanism (the inputs of each checkpointed
call, `CheckpointFunction`'s `deepspeed_saved_tensors`: a recomputed chunk's input under full recomputation,
the core attention's q, k, v under selective recomputation). Parameters are not counted.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())


def param_keys(module: torch.nn.Module) -> set[tuple[int, int]]:
    """Storage keys of every parameter and, under ZeRO-3, its partition (`ds_tensor`)."""
    tensors = [p for p in module.parameters()] + [
        p.ds_tensor for p in module.parameters() if getattr(p, "ds_tensor", None) is not None
    ]
    return {_storage_key(t) for t in tensors if t.untyped_storage().nbytes()}


class ActivationPeak:
    """Peak bytes of tensors saved for backward while `track()` is active."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.param_keys = param_keys(module)
        self.live: dict[tuple[int, int], list[int]] = {}  # key -> [refcount, bytes]
        self.current = 0
        self.peak = 0

    def _release(self, key: tuple[int, int]) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]

    def _pack(self, t: torch.Tensor) -> Any:
        key = _storage_key(t)
        if key in self.param_keys or t.device.type == "meta":
            return t
        entry = self.live.setdefault(key, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        holder = _Saved(t)
        weakref.finalize(holder, self._release, key)
        return holder

    @staticmethod
    def _unpack(obj: Any) -> torch.Tensor:
        return obj.tensor if isinstance(obj, _Saved) else obj

    def _keep(self, t: torch.Tensor) -> None:
        """Count `t` while its Python object lives (a checkpoint input, held by the checkpoint's context)."""
        key = _storage_key(t)
        if key in self.param_keys or t.device.type == "meta" or not t.untyped_storage().nbytes():
            return
        entry = self.live.setdefault(key, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        weakref.finalize(t, self._release, key)

    @contextmanager
    def track(self) -> Iterator[None]:
        from deepspeed.runtime.activation_checkpointing import checkpointing

        original = checkpointing.extract_tensors

        def extract(all_objects: Any) -> Any:
            tensors, others, flags = original(all_objects=all_objects)
            if sys._getframe(1).f_code.co_name == "save_args_for_backward":  # the inputs kept for recompute
                for t in tensors:
                    if isinstance(t, torch.Tensor):
                        self._keep(t)
            return tensors, others, flags

        checkpointing.extract_tensors = extract
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            checkpointing.extract_tensors = original


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
