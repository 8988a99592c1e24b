"""Unpickling other tools' files without running code from them.

Megatron-DeepSpeed's `mp_rank` files and Megatron-LM's `common.pt` / `model_optim_rng.pt` pickle
the run's `args` (an argparse.Namespace holding Megatron's enums, torch dtypes, a signal number)
beside tensors; torch's distributed checkpoint pickles its `.metadata` (dataclasses of
`torch.distributed.checkpoint`). Each is read by an unpickler that admits only the globals such a
file is expected to hold (`upstream_values`, `dcp_metadata`) and refuses any other with
`pickle.UnpicklingError`. Upstream's own classes are never imported: their values become `Inert`
records (the arguments they were pickled with, and their state).

    torch.load(path, weights_only=False, pickle_module=pickle_module(upstream_values))
"""

from __future__ import annotations

import argparse
import builtins
import collections
import importlib
import pathlib
import pickle
import types
from collections.abc import Callable
from typing import Any

import torch

INERT_MODULES = ("megatron", "numpy", "signal")
"""Packages whose pickled values are kept as inert records (Megatron's enums and `--exit-signal` in
`args`, numpy's RNG state): never imported."""
_TENSOR_REBUILDERS = ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_parameter", "_rebuild_from_type_v2")
_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
)
"""Where the dataclasses and enums of a distributed checkpoint's `.metadata` live."""

Allow = Callable[[str, str], Any]
"""(module, name) -> the object that global stands for, or None when refused."""


class Inert:
    """An upstream value as data: the arguments it was pickled with and its state; nothing runs."""

    qualname = "?"

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname}{self.args!r}>"


_inert_types: dict[str, type] = {}


def _inert(module: str, name: str) -> type:
    qualname = f"{module}.{name}"
    if qualname not in _inert_types:
        _inert_types[qualname] = type(name, (Inert,), {"qualname": qualname})
    return _inert_types[qualname]


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    """Protocol-2 pickles spell bytes as `_codecs.encode(text, "latin1")` (numpy's RNG state does)."""
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"holds bytes in encoding {encoding!r}, which such a file does not hold")
    return text.encode("latin1")


def _torch_value(module: str, name: str) -> Any:
    """Tensors, storages' rebuilders, dtypes and torch's small value types."""
    if module == "torch._utils" and name in _TENSOR_REBUILDERS:
        return getattr(torch._utils, name)
    if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):  # a tensor with attributes set (as
        return torch._tensor._rebuild_from_type_v2  # torch's weights_only loader admits it; its parts are checked here)
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    plain = {"Size": torch.Size, "device": torch.device, "Tensor": torch.Tensor}
    if module == "torch" and name in plain:
        return plain[name]
    if (module, name) == ("torch.nn.parameter", "Parameter"):
        return torch.nn.Parameter
    return None


def upstream_values(module: str, name: str) -> Any:
    """A global of a Megatron checkpoint's pickled state (args, counters, tensors)."""
    if (module, name) == ("argparse", "Namespace"):
        return argparse.Namespace
    if (module, name) == ("collections", "OrderedDict"):
        return collections.OrderedDict
    if (module, name) == ("_codecs", "encode"):
        return _latin1
    if module == "builtins" and name in ("set", "frozenset", "slice", "complex"):
        return getattr(builtins, name)
    found = _torch_value(module, name)
    if found is not None:
        return found
    if module.split(".")[0] in INERT_MODULES:
        return _inert(module, name)
    return None


def dcp_metadata(module: str, name: str) -> Any:
    """A global of torch's distributed-checkpoint `.metadata`: its own dataclasses and enums (plain
    records, imported from torch), `torch.Size`, dtypes, pure paths, and the layout looked up by name; megatron-core's
    own classes there (`MCoreMetadata`, `MCoreSavePlan` of its releases up to 0.15) as inert records."""
    if module.split(".")[0] == "megatron":
        return _inert(module, name)
    if module in _DCP_MODULES and not name.startswith("__"):
        found = getattr(importlib.import_module(module), name, None)
        if isinstance(found, type):
            return found
    if (module, name) == ("torch.serialization", "_get_layout"):
        return _layout
    if module == "builtins" and name in ("set", "frozenset"):
        return getattr(builtins, name)
    if module == "pathlib" and name in _PURE_PATHS:  # torch's own writer records the checkpoint's path
        return _PURE_PATHS[name]
    return _torch_value(module, name)


_PURE_PATHS = {
    "PosixPath": pathlib.PurePosixPath,
    "PurePosixPath": pathlib.PurePosixPath,
    "WindowsPath": pathlib.PureWindowsPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
}
"""Paths in a `.metadata` (torch's `StorageMeta.checkpoint_id`) as pure paths: strings, no file access."""


def _layout(name: str) -> torch.layout:
    """torch's `_get_layout`: a layout from its printed name, e.g. 'torch.strided'."""
    found = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(found, torch.layout):
        raise pickle.UnpicklingError(f"holds an unknown tensor layout {name!r}")
    return found


def unpickler(allow: Allow) -> type[pickle.Unpickler]:
    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found = allow(module, name)
            if found is None:
                raise pickle.UnpicklingError(f"holds a pickled {module}.{name}, which such a file does not hold")
            return found

    return Restricted


def pickle_module(allow: Allow) -> types.SimpleNamespace:
    """What `torch.load(pickle_module=...)` takes: storages through torch's persistent ids, every
    other global through `allow`."""
    return types.SimpleNamespace(__name__="restricted_pickle", Unpickler=unpickler(allow), load=pickle.load)


def load(file: Any, allow: Allow) -> Any:
    """A plain pickle (no tensors) from an open binary file."""
    return unpickler(allow)(file).load()
