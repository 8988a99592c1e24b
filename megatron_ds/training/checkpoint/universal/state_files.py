"""DeepSpeed's state files, each unpickled once per conversion, and the tensors in them read from disk one by one.

A conversion reads every parameter's fp32 master and Adam moments: a fragment of each ZeRO partition file that holds
part of it, or its entry in a torch optimizer's state (without ZeRO, and a mixture-of-experts run's per-expert
files). Loading the file for each of those reads unpickled it parameters x states times (5-200 ms a time: ~1,000
times for a six-layer model on two data-parallel ranks, 8-12 s of a tiny MoE conversion's 16). Here a file's
structure is unpickled once, with every tensor on the meta device (`torch.load(map_location="meta")`, the same
`weights_only` loader and allow-list: no data read, no code run; torch records where each storage starts in the
file), and `narrow` (a fragment of a flat partition) or `materialize` (any tensor) reads its bytes from the file at
that offset. No page of the file stays mapped, so a conversion still holds one tensor at a time, as when each read
memory-mapped the file anew.

Where torch records no offsets (older versions) or the file was written big-endian, `StateFiles.open` returns the
memory-mapped file and `narrow` and `materialize` copy out of it, as before.

`load_file` is the one loader of DeepSpeed's state files (ours, Megatron-DeepSpeed's): `weights_only`, with only
DeepSpeed's few classes in them allow-listed.
"""

from __future__ import annotations

import os
import pickle
import sys
import zipfile
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch

from megatron_ds import files
from megatron_ds.training.checkpoint.directory import CheckpointError


@lru_cache(maxsize=1)
def _allowed_globals() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_file(path: str, map_location: str = "cpu") -> dict[str, Any]:
    """A DeepSpeed state file, memory-mapped (or its structure alone: `map_location="meta"`), with no code run but
    DeepSpeed's allow-listed classes."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete")
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=map_location != "meta")
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(files.load_failure(path, err, "the checkpoint is damaged")) from None


class StateFiles:
    """The state files of one checkpoint as one conversion reads them."""

    def __init__(self, load: Callable[..., dict[str, Any]] = load_file) -> None:
        self._load = load  # the restricted loader (a test passes one that counts its calls)
        self._structures: dict[str, dict[str, Any] | None] = {}

    def open(self, path: str) -> dict[str, Any]:
        """The file's contents: tensors on the meta device (read them with `narrow`) where offsets are known."""
        if path not in self._structures:
            self._structures[path] = self._structure(path)
        found = self._structures[path]
        return found if found is not None else self._load(path)

    def _structure(self, path: str) -> dict[str, Any] | None:
        if sys.byteorder != "little" or _byte_order(path) not in (None, "little"):
            return None
        structure = self._load(path, map_location="meta")
        probe = _first_tensor(structure)
        if probe is not None and not hasattr(probe.untyped_storage(), "_checkpoint_offset"):
            return None  # this torch does not say where storages are
        return structure


def narrow(flat: torch.Tensor, start: int, numel: int, path: str) -> torch.Tensor:
    """Elements [start, start + numel) of a flat partition from `StateFiles.open` as a tensor of their own; a
    RuntimeError when the file does not hold them (callers name the file as damaged)."""
    if flat.dim() != 1 or start < 0 or numel < 0 or start + numel > flat.numel():
        raise RuntimeError(f"elements {start}..{start + numel} are outside a flat partition of {flat.numel()}")
    return materialize(flat.narrow(0, start, numel), path)


def materialize(value: Any, path: str) -> Any:
    """`value` from `StateFiles.open` with its data: a tensor on the meta device read from `path` (a tensor of its
    own, whatever its strides), anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()  # DeepSpeed saved the fp32 partitions with requires_grad
    if not value.is_meta:  # memory-mapped: a copy, so that the mapping can go
        return value.clone()
    if value.numel() == 0:
        return torch.empty(value.shape, dtype=value.dtype)
    span = 1 + sum((n - 1) * s for n, s in zip(value.shape, value.stride()))  # elements from the first to the last
    data = _read(path, value, value.storage_offset(), span)
    return data.view(value.shape) if value.is_contiguous() else data.as_strided(value.shape, value.stride()).clone()


def _read(path: str, like: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """`count` elements of `like`'s storage from element `first`, read from the file."""
    size = like.element_size()
    storage = like.untyped_storage()
    if (first + count) * size > storage.nbytes():
        raise RuntimeError(f"elements up to {first + count} are outside a storage of {storage.nbytes() // size}")
    if count == 0:
        return torch.empty(0, dtype=like.dtype)
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), count * size, storage._checkpoint_offset + first * size)
    if len(data) != count * size:
        raise RuntimeError(f"the file ends {count * size - len(data)} bytes before the tensor's end")
    return torch.frombuffer(bytearray(data), dtype=like.dtype)


def _byte_order(path: str) -> str | None:
    """The `byteorder` record torch writes beside the data (None in files from before it did)."""
    try:
        with zipfile.ZipFile(path) as z:
            name = next((n for n in z.namelist() if n.rpartition("/")[2] == "byteorder"), None)
            return None if name is None else z.read(name).decode().strip()
    except (OSError, zipfile.BadZipFile, UnicodeDecodeError):
        return "unreadable"  # the loader then says what is wrong with the file


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    children = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for child in children:
        found = _first_tensor(child)
        if found is not None:
            return found
    return None
