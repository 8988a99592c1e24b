"""Atomic output directories and safetensors shards, shared by export and import.

Output is written into a temporary directory next to the target and renamed into place only when
complete and validated, so a failed conversion leaves nothing behind and never touches the source.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from megatron_ds.errors import UserError

SAFETENSORS_INDEX = "model.safetensors.index.json"


class OutputExistsError(UserError):
    """The output directory already exists; conversions never overwrite."""


@contextlib.contextmanager
def atomic_directory(target: str, flag: str) -> Iterator[str]:
    """Yield a temporary directory that becomes `target` when the block ends without an error."""
    target = os.path.abspath(target)
    if os.path.lexists(target) and not (os.path.isdir(target) and not os.listdir(target)):
        raise OutputExistsError(f"{flag} {target}: already exists; choose a new directory (nothing is overwritten)")
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.incomplete.", dir=parent)
    except OSError as err:
        raise UserError(f"{flag} {target}: cannot write there ({err.strerror}); choose a writable directory") from None
    try:
        yield tmp
        _set_permissions(tmp)
        if os.path.isdir(target):
            os.rmdir(target)  # the empty directory checked above
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _set_permissions(directory: str) -> None:
    # mkdtemp makes a private directory; give the result the permissions of any new directory.
    umask = os.umask(0)
    os.umask(umask)
    for parent, _dirs, names in os.walk(directory):
        os.chmod(parent, 0o777 & ~umask)
        for name in names:
            os.chmod(os.path.join(parent, name), 0o666 & ~umask)


def write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=False)
        f.write("\n")


class ShardWriter:
    """Write tensors to `model.safetensors`, or to numbered shards of at most `max_bytes` plus
    the HF index; memory holds at most one shard's tensors."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(
            self.pending, os.path.join(self.directory, f"shard-{len(self.shards)}.tmp"), metadata={"format": "pt"}
        )
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Finish; returns the file names written."""
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            os.replace(os.path.join(self.directory, f"shard-{i}.tmp"), os.path.join(self.directory, name))
        if n > 1:
            weight_map = {t: names[i] for i, shard in enumerate(self.shards) for t in shard}
            write_json(
                os.path.join(self.directory, SAFETENSORS_INDEX),
                {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map},
            )
            names.append(SAFETENSORS_INDEX)
        return names


def progress(total: int, description: str, enabled: bool) -> Any:
    """A tqdm progress bar on stderr (shown on terminals only), or a stand-in without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc=description, unit="tensor", disable=None if enabled else True, leave=False)


class _NoProgress:
    def update(self, n: int = 1) -> None:
        del n

    def close(self) -> None:
        pass
