"""The files of a Megatron-LM checkpoint, read without running code from them.

    ROOT/latest_checkpointed_iteration.txt   N (or `release`)
    ROOT/iter_000000N/                        `--ckpt-format torch_dist` (the default since 2024):
        metadata.json                         {"sharded_backend": "torch_dist", ...}
        common.pt                             what is not sharded: `args` (the run's Namespace),
                                              `iteration`, `opt_param_scheduler`, ...
        .metadata, __R_I.distcp               torch's distributed checkpoint: every sharded tensor
                                              under megatron-core's canonical name (one name for the
                                              local and Transformer Engine layer specs; a layer's
                                              tensors stacked over the layers on dim 0, an expert's
                                              over the layers and the global experts), in chunks
    ROOT/iter_000000N/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt   `--ckpt-format torch`: per tensor
                                              rank TT (pipeline stage PPP when P > 1, expert-parallel
                                              rank EEE when EP > 1) the stage's `state_dict` (layers
                                              numbered from 0 on each stage, experts from 0 on each
                                              expert-parallel rank) beside the same entries as common.pt

Tensors are read with `weights_only=True` (each distributed-checkpoint chunk is its own `torch.save`
blob at an offset the metadata gives). The pickled `.metadata`, `common.pt` and `model_optim_rng.pt`
go through `restricted_pickle`: torch's checkpoint dataclasses, argparse's Namespace, tensors and
dtypes; Megatron's enums as inert records; anything else refused. Nothing of Megatron is imported.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_ds import files
from megatron_ds.errors import first_line
from megatron_ds.interop import restricted_pickle
from megatron_ds.interop.megatron_lm_experts import GROUPED_EXPERTS, global_experts
from megatron_ds.interop.saved_flags import SavedArgs, check_saved_args
from megatron_ds.training.checkpoint.directory import MEGATRON_TRACKER, CheckpointError

TORCH_DIST, TORCH = "torch_dist", "torch"
COMMON = "common.pt"
DCP_METADATA = ".metadata"
CONFIG = "metadata.json"
RANK_FILE = "model_optim_rng.pt"
_ITERATION_DIR = re.compile(r"iter_(\d{7,})$")
_TORCH_LOAD = restricted_pickle.pickle_module(restricted_pickle.upstream_values)


def load_pickled_state(path: str) -> dict[str, Any]:
    """`common.pt` or a `model_optim_rng.pt`: tensors memory-mapped, other globals restricted."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_TORCH_LOAD, mmap=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError, AttributeError) as err:
        raise CheckpointError(files.load_failure(path, err, "the checkpoint is damaged or not Megatron-LM's")) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a dictionary of states; the checkpoint is damaged")
    return state


@dataclass(frozen=True)
class MegatronLMCheckpoint(SavedArgs):
    """One iteration directory of a Megatron-LM checkpoint and the run's saved arguments."""

    directory: str
    iteration: int
    """0 for a `release` checkpoint."""
    format: str
    """TORCH_DIST or TORCH."""
    args: dict[str, Any]
    """`vars()` of the saved Namespace (Megatron's enums as `restricted_pickle.Inert` records)."""
    states: dict[str, Any] = field(repr=False)
    """The saved entries other than `args`, the model and the optimizer."""
    optimizer: dict[Any, Any] | None = field(default=None, repr=False)
    """The saved `optimizer` entry: torch_dist's common.pt (its param groups and step; the moments are
    sharded tensors, `optimizer.state.<state>.<model tensor>` or buckets), `torch`'s first rank file (the
    optimizer's `state_dict()`; the distributed optimizer's moments are in `distrib_optim.pt`); None
    without one. megatron-core's ChainedOptimizer (a mixture of experts: the dense parameters' optimizer, then the
    experts') saves one such entry per optimizer, here under 0, 1, ..."""

    @property
    def expert_parallel(self) -> int:
        return int(self.args.get("expert_model_parallel_size") or 1)

    def rank_file(self, tensor_rank: int, stage: int, expert_rank: int = 0) -> str:
        """`--ckpt-format torch`: the file of one tensor rank, pipeline stage and expert-parallel rank (Megatron-LM's
        `get_checkpoint_name`: `mp_rank_TT[_PPP][_EEE]`)."""
        name = f"mp_rank_{tensor_rank:02d}" + (f"_{stage:03d}" if self.pipeline_parallel > 1 else "")
        name += f"_{expert_rank:03d}" if self.expert_parallel > 1 else ""
        return os.path.join(self.directory, name, RANK_FILE)


def find_iteration_directory(path: str) -> str:
    """The iteration directory from a checkpoint root (the tracker file) or the directory itself."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory; give a Megatron-LM checkpoint directory (--save)")
    if _format(path) is not None:
        return path
    tracker = os.path.join(path, MEGATRON_TRACKER)
    if os.path.isfile(tracker):
        text = open(tracker).read().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
        if name is None:
            raise CheckpointError(f"{tracker}: holds {text!r}, not an iteration number or 'release'; it is damaged")
        found = os.path.join(path, name)
        if _format(found) is not None:
            return found
        if text.isdigit() and os.path.isdir(os.path.join(path, f"global_step{int(text)}")):  # the same tracker file
            raise CheckpointError(
                f"{path}: a Megatron-DeepSpeed checkpoint (global_step{int(text)}), not a Megatron-LM one; convert it "
                f"with --from megatron-deepspeed"
            )
        raise CheckpointError(f"{tracker}: names {name}, which holds no Megatron-LM checkpoint; it is incomplete")
    raise CheckpointError(
        f"{path}: not a Megatron-LM checkpoint (no {MEGATRON_TRACKER}, no {CONFIG} or mp_rank_00 directory); give the "
        f"directory its run passed as --save, or one of its iter_NNNNNNN directories"
    )


def _format(directory: str) -> str | None:
    if os.path.isfile(os.path.join(directory, CONFIG)):
        return TORCH_DIST
    if _first_rank_file(directory) is not None:
        return TORCH
    return None


def _first_rank_file(directory: str) -> str | None:
    """The first rank's `model_optim_rng.pt` (`mp_rank_00`, with pipeline or expert parallelism `mp_rank_00_000`,
    with both `mp_rank_00_000_000`), or None."""
    found = (os.path.join(directory, d, RANK_FILE) for d in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"))
    return next((f for f in found if os.path.isfile(f)), None)


def _backend(directory: str) -> None:
    path = os.path.join(directory, CONFIG)
    try:
        with open(path) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{path}: unreadable ({first_line(err)}); the checkpoint is damaged") from None
    if backend != TORCH_DIST:
        raise CheckpointError(
            f"{path}: sharded backend {backend!r}; only torch_dist (Megatron-LM's default) converts here; convert it "
            f"upstream first (tools/checkpoint/convert.py, or a load and save with --ckpt-format torch_dist)"
        )


def open_megatron_lm(path: str) -> MegatronLMCheckpoint:
    directory = find_iteration_directory(path)
    fmt = _format(directory)
    if fmt == TORCH_DIST:
        _backend(directory)
        first = os.path.join(directory, COMMON)
    else:
        first = _first_rank_file(directory) or os.path.join(directory, "mp_rank_00", RANK_FILE)
    state = load_pickled_state(first)
    args = state.get("args")
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{first}: no saved 'args'; not a checkpoint Megatron-LM's pretrain_gpt.py wrote")
    kept = {k: v for k, v in state.items() if k not in ("args", "optimizer") and not k.startswith("model")}
    if any(k.startswith("model") and k != "model" for k in state):
        raise CheckpointError(
            f"{first}: holds one model per virtual pipeline stage (model0, model1, ...); a --ckpt-format torch "
            f"checkpoint of an interleaved run does not convert here; save it as torch_dist upstream first"
        )
    name = os.path.basename(directory)
    match = _ITERATION_DIR.match(name)
    iteration = int(match.group(1)) if match else int(state.get("iteration") or 0)
    optimizer = state.get("optimizer")
    if isinstance(optimizer, list):  # megatron-core's ChainedOptimizer (dense and expert optimizers): one per entry
        optimizer = dict(enumerate(optimizer))
    optimizer = optimizer if isinstance(optimizer, dict) else None
    ckpt = MegatronLMCheckpoint(directory, iteration, str(fmt), dict(vars(args)), kept, optimizer)
    check_saved_args(ckpt.args, first)
    return ckpt


# ----- torch_dist: torch's distributed checkpoint, chunk by chunk --------------------------------


class DistTensors:
    """The tensors of a torch_dist iteration directory, read chunk by chunk."""

    def __init__(self, directory: str) -> None:
        from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

        self.directory = directory
        path = os.path.join(directory, DCP_METADATA)
        try:
            with open(path, "rb") as f:
                metadata = restricted_pickle.load(f, restricted_pickle.dcp_metadata)
        except (OSError, pickle.UnpicklingError, EOFError, ValueError, AttributeError, TypeError) as err:
            raise CheckpointError(files.load_failure(path, err, "the checkpoint is damaged")) from None
        fields = _metadata_fields(metadata, Metadata)
        if fields is None:
            raise CheckpointError(f"{path}: not a distributed checkpoint's metadata; the checkpoint is damaged")
        tensors, storage = fields
        self.tensors = {k: v for k, v in tensors.items() if isinstance(v, TensorStorageMetadata)}
        self.storage = {
            (index.fqn, tuple(index.offset)): info for index, info in storage.items() if index.offset is not None
        }
        self.objects = {index.fqn: info for index, info in storage.items() if index.offset is None}
        """Pickled entries (megatron-core's ShardedObjects, `<key>/shard_<i>_<n>`) by name."""

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def read(self, key: str, layer: int | None = None, expert: int | None = None) -> torch.Tensor:
        """Tensor `key` whole, or its slice `layer` on dim 0 (a layer of a stacked layer tensor), and of that its
        slice `expert` on the next dim (one expert of a layer's stacked experts)."""
        meta = self.tensors[key]
        index = tuple(i for i in (layer, expert) if i is not None)
        assert expert is None or layer is not None, key
        size = tuple(meta.size)
        out = torch.empty(size[len(index) :], dtype=meta.properties.dtype)
        covered = 0
        for chunk in meta.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if not all(o <= i < o + n for i, o, n in zip(index, offsets, sizes)):
                continue
            blob = self.chunk(key, offsets, sizes)
            blob = blob[tuple(i - o for i, o in zip(index, offsets))]
            offsets, sizes = offsets[len(index) :], sizes[len(index) :]
            out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].copy_(blob)
            covered += blob.numel()
        if covered != out.numel():
            where = key + "".join(f"[{i}]" for i in index)
            raise CheckpointError(
                f"{self.directory}: {where} has {covered} of its {out.numel()} elements in the checkpoint's chunks; "
                f"it is incomplete"
            )
        return out

    def read_object(self, name: str) -> Any:
        """Pickled entry `name`, loaded with `weights_only=True` (plain containers, numbers, strings, tensors,
        dtypes: no code runs)."""
        return self._load(self.objects[name], f"{name} is unreadable")

    def chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The stored chunk of `key` at `offsets` (a `sizes` tensor, as one rank saved it)."""
        info = self.storage.get((key, offsets))
        if info is None:
            raise CheckpointError(f"{self.directory}: no stored chunk of {key} at {list(offsets)}; it is incomplete")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{self.directory}: {key} is stored transformed ({info.transform_descriptors}); only plain chunks "
                f"are read here"
            )
        blob = self._load(info, f"unreadable at {info.offset}")
        if not isinstance(blob, torch.Tensor) or tuple(blob.shape) != sizes:
            raise CheckpointError(
                f"{os.path.join(self.directory, info.relative_path)}: the chunk of {key} at {list(offsets)} is not a "
                f"{list(sizes)} tensor; damaged"
            )
        return blob

    def _load(self, info: Any, failure: str) -> Any:
        """The `torch.save` blob `info` locates, read in place (one copy in memory, not the file bytes and then
        the value) with `weights_only=True`; `failure` heads the error of a damaged one."""
        path = os.path.join(self.directory, info.relative_path)
        try:
            with open(path, "rb") as f:
                return torch.load(
                    io.BufferedReader(_FileSlice(f, info.offset, info.length)), map_location="cpu", weights_only=True
                )
        except (OSError, RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as err:
            refused = files.refused_pickle(path, err)
            raise CheckpointError(refused or f"{path}: {failure} ({first_line(err)}); it is damaged") from None


def _metadata_fields(metadata: Any, metadata_type: type) -> tuple[dict[str, Any], dict[Any, Any]] | None:
    """(state_dict_metadata, storage_data) of torch's Metadata, or of megatron-core's `MCoreMetadata` (its
    subclass in releases up to 0.15, unpickled as an inert record holding the same fields); None otherwise."""
    if isinstance(metadata, metadata_type):
        return metadata.state_dict_metadata, metadata.storage_data or {}
    state = metadata.state if isinstance(metadata, restricted_pickle.Inert) else None
    if isinstance(state, dict) and isinstance(state.get("state_dict_metadata"), dict):
        return state["state_dict_metadata"], state.get("storage_data") or {}
    return None


class _FileSlice(io.RawIOBase):
    """Bytes `offset` to `offset + length` of an open binary file, as a seekable file of their own."""

    def __init__(self, file: Any, offset: int, length: int) -> None:
        super().__init__()
        self.file, self.offset, self.length, self.position = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = min(max(base + position, 0), self.length)
        return self.position

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.length - self.position)
        if n <= 0:
            return 0
        self.file.seek(self.offset + self.position)
        got = self.file.readinto(memoryview(buffer)[:n])
        self.position += got
        return got


# ----- torch: one state dict per tensor rank and stage --------------------------------------------


class RankTensors:
    """The model tensors of a `--ckpt-format torch` iteration directory, per tensor rank and stage."""

    def __init__(self, ckpt: MegatronLMCheckpoint) -> None:
        self.ckpt = ckpt
        self._models: dict[tuple[int, int], dict[str, Any]] = {}
        layers = [self._layer_count(stage) for stage in range(ckpt.pipeline_parallel)]
        self.first_layer = [sum(layers[:s]) for s in range(len(layers))]
        """Each stage's first layer's global number (a stage numbers its layers from 0)."""
        self.num_layers = sum(layers)

    def model(self, tensor_rank: int, stage: int) -> dict[str, Any]:
        """The stage's state dict on `tensor_rank`; with expert parallelism the first expert-parallel rank's, its
        experts those of every expert-parallel rank under their global index (`megatron_lm_experts.global_experts`)."""
        if (tensor_rank, stage) not in self._models:
            models = [self._load(tensor_rank, stage, r) for r in range(self.ckpt.expert_parallel)]
            self._models[tensor_rank, stage] = global_experts(models, self.ckpt.rank_file(tensor_rank, stage))
        return self._models[tensor_rank, stage]

    def _load(self, tensor_rank: int, stage: int, expert_rank: int) -> dict[str, Any]:
        path = self.ckpt.rank_file(tensor_rank, stage, expert_rank)
        model = load_pickled_state(path).get("model")
        if not isinstance(model, dict):
            raise CheckpointError(f"{path}: no 'model' state dict; the checkpoint is damaged or saved without it")
        grouped = next((k for k in model if GROUPED_EXPERTS.search(k)), None)
        if grouped is not None:
            raise CheckpointError(
                f"{path}: its experts are stored as one grouped-GEMM tensor ({grouped}: --moe-grouped-gemm), which "
                f"is read here only from --ckpt-format torch_dist; load it in Megatron-LM and save it with "
                f"--ckpt-format torch_dist"
            )
        return model

    def _layer_count(self, stage: int) -> int:
        found = {int(m.group(1)) for k in self.model(0, stage) if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}
        return max(found) + 1 if found else 0

    def keys(self, stage: int) -> list[str]:
        return [k for k, v in self.model(0, stage).items() if isinstance(v, torch.Tensor)]

    def find(self, names: tuple[str, ...], layer: int | None) -> tuple[int, str] | None:
        """(stage, key) of the first of `names` (a layer tensor's name without its layer prefix) stored."""
        for stage in range(self.ckpt.pipeline_parallel):
            for name in names:
                key = name if layer is None else self._layer_key(stage, layer, name)
                if key is not None and isinstance(self.model(0, stage).get(key), torch.Tensor):
                    return stage, key
        return None

    def _layer_key(self, stage: int, layer: int, name: str) -> str | None:
        local = layer - self.first_layer[stage]
        last = self.first_layer[stage + 1] if stage + 1 < len(self.first_layer) else self.num_layers
        return f"decoder.layers.{local}.{name}" if 0 <= layer < last and local >= 0 else None

    def shards(self, stage: int, key: str) -> list[torch.Tensor]:
        shards = []
        for rank in range(self.ckpt.tensor_parallel):
            value = self.model(rank, stage).get(key)
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"{self.ckpt.rank_file(rank, stage)}: no tensor {key!r}; the checkpoint is damaged"
                )
            shards.append(value.detach().clone())
        return shards
