"""megatron-core's index caches (`GPTDataset`'s document, sample and shuffle indices; `BlendedDataset`'s
blending index), written atomically and read with one-line errors. megatron-core itself is not changed.

megatron-core writes each `.npy` straight onto its final name, and a cache hit is "every file exists": a
rank 0 killed inside a write (SIGKILL, OOM, node loss) left a short file that every later run took for a
hit and failed on (`ValueError: mmap length is greater than file size`). While `cache_io()` is active,
megatron-core's dataset modules see a `numpy` whose `save` writes a temporary file next to the target and
renames it into place (so a cache file exists only complete), and whose `load` turns an unreadable file
into `DamagedIndexCache` naming it. `rebuilt_if_damaged` deletes such a file where the indices are built
(rank 0, or a single process) and builds again: the missing file is a cache miss, so megatron-core
rebuilds the whole entry; elsewhere the error is one line telling to delete it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from megatron_ds.data import DataError
from megatron_ds.errors import first_line

T = TypeVar("T")
DATASET_MODULES = ("megatron.core.datasets.gpt_dataset", "megatron.core.datasets.blended_dataset")
"""The megatron-core modules that save and load index caches (each imports `numpy` as `numpy`)."""
BLENDED_LOGGER = "megatron.core.datasets.blended_dataset"
UNSAVED_BLEND = "Cannot save the BlendedDataset indexes because path_to_cache is None"
"""megatron-core's warning for a blend built without a cache path: each split, each start."""


class DamagedIndexCache(DataError):
    """An index-cache file megatron-core cannot read (cut short by a killed write, or damaged)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(
            f"index cache {path} is unreadable ({reason}), e.g. cut short by a process killed while writing it; "
            "delete it and start again: the indices are rebuilt"
        )
        self.path, self.reason = path, reason


def _save(file: Any, arr: Any, *args: Any, **kwargs: Any) -> None:
    """`numpy.save` onto a path through a temporary file in the same directory, renamed when complete."""
    if not isinstance(file, (str, os.PathLike)):
        np.save(file, arr, *args, **kwargs)
        return
    path = os.fspath(file)
    if not path.endswith(".npy"):
        path += ".npy"  # numpy.save's rule for a path
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr, *args, **kwargs)
            f.flush()
            os.fsync(f.fileno())  # complete on disk before the name says so (a node lost right after)
        os.chmod(tmp, 0o666 & ~_umask())  # as numpy.save's own file would be
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _load(file: Any, *args: Any, **kwargs: Any) -> Any:
    """`numpy.load`, a file it cannot read a `DamagedIndexCache` naming it."""
    try:
        return np.load(file, *args, **kwargs)
    except FileNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001 - ValueError (cut short), EOFError (empty), UnpicklingError (garbage)
        if not isinstance(file, (str, os.PathLike)):
            raise
        raise DamagedIndexCache(os.fspath(file), first_line(err)) from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class _CacheNumpy:
    """numpy, but for `save` and `load` (`_save`, `_load`): what megatron-core's dataset modules see."""

    save = staticmethod(_save)
    load = staticmethod(_load)

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


class _DropUnsavedBlend(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(UNSAVED_BLEND)


@contextlib.contextmanager
def cache_io() -> Iterator[None]:
    """While building megatron-core datasets: atomic cache writes, unreadable cache files as one-line errors,
    and no warning for a blend index built in memory (cheap; megatron-core caches a blend's only with a
    cache path under torch.distributed, `gpt_data._build_part`)."""
    modules = [sys.modules[name] for name in DATASET_MODULES if name in sys.modules]
    modules = [m for m in modules if getattr(m, "numpy", None) is np]
    quiet = _DropUnsavedBlend()
    logging.getLogger(BLENDED_LOGGER).addFilter(quiet)
    for m in modules:
        m.numpy = _CacheNumpy()
    try:
        yield
    finally:
        for m in modules:
            m.numpy = np
        logging.getLogger(BLENDED_LOGGER).removeFilter(quiet)


def rebuilt_if_damaged(build: Callable[[], T], builds_caches: bool) -> T:
    """`build()` (a megatron-core dataset under `cache_io`); where the caches are built (`builds_caches`: rank 0
    or a single process), an unreadable cache file is deleted, said in one line, and the dataset built again."""
    try:
        return build()
    except DamagedIndexCache as err:
        if not builds_caches:
            raise
        os.remove(err.path)
        print(f"NOTICE: index cache {err.path} was unreadable ({err.reason}): deleted, rebuilding", flush=True)
    return build()
