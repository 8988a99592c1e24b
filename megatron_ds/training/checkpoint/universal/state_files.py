"""DeepSpeed's state files, each unpickled once per conversion, and slices of their flat partitions read from disk.

A conversion reads every parameter's fragment of every state (fp32 masters, Adam's moments) from each ZeRO
partition file that holds part of it. Loading the file for each of those reads unpickled it parameters x states
times (5 ms a time for a tiny model's file, ~1,000 times for a six-layer one on two data-parallel ranks). Here a
file's structure is unpickled once, with every tensor on the meta device (`torch.load(map_location="meta")`,
the same `weights_only` loader and allow-list: no data read, no code run; torch records where each storage
starts in the file), and `narrow` reads a fragment's bytes from the file at that offset. No page of the file stays
mapped, so a conversion still holds one fragment at a time, as when each read memory-mapped the file anew.

Where torch records no offsets (older versions) or the file was written big-endian, `StateFiles.open` returns the
memory-mapped file and `narrow` copies the fragment out of it, as before.
"""

from __future__ import annotations

import os
import sys
import zipfile
from typing import Any

import torch


class StateFiles:
    """The state files of one checkpoint as one conversion reads them."""

    def __init__(self, load: Any) -> None:
        self._load = load  # deepspeed_source.load_file: the restricted loader, taking map_location
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
    flat = flat.detach()  # DeepSpeed saved the fp32 partitions with requires_grad
    if not flat.is_meta:  # memory-mapped: copy the slice so the mapping can go
        return flat.narrow(0, start, numel).clone()
    size = flat.element_size()
    storage = flat.untyped_storage()
    end = (flat.storage_offset() + start + numel) * size
    if flat.dim() != 1 or flat.stride(0) != 1 or start < 0 or numel < 0 or start + numel > flat.numel():
        raise RuntimeError(f"elements {start}..{start + numel} are outside a flat partition of {flat.numel()}")
    if end > storage.nbytes():
        raise RuntimeError(f"elements up to {end // size} are outside a storage of {storage.nbytes() // size}")
    offset = storage._checkpoint_offset + (flat.storage_offset() + start) * size
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), numel * size, offset)
    if len(data) != numel * size:
        raise RuntimeError(f"the file ends {numel * size - len(data)} bytes before the partition's end")
    if numel == 0:
        return torch.empty(0, dtype=flat.dtype)
    return torch.frombuffer(bytearray(data), dtype=flat.dtype)


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
