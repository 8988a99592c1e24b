"""Adam's state from the distributed optimizer's flat buffers in a Megatron-LM checkpoint, named by model
tensor. Pure reading; nothing of Megatron is imported.

Two ways upstream saves them, one layout (megatron-core's `_ParamAndGradBuffer`: a tensor and pipeline
rank's parameters in reverse registration order, each starting at a multiple of 64 elements, in buckets
whose ends are padded to a data-parallel multiple; `param` is the fp32 master weight):
  torch_dist, `dp_reshardable` (the default `distrib_optim_sharding_type`; `fully_sharded_bucket_space`
      before megatron-core 0.14): per model-parallel rank g, buffer b (one per parameter dtype) and bucket
      k, one flat tensor per state, `optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_<dtypes>.
      bucket_idx_<k>.<param|exp_avg|exp_avg_sq>`, up to the bucket's last parameter (`DistBuckets`);
  `--ckpt-format torch` with --use-distributed-optimizer: `distrib_optim.pt` beside each rank's
      `model_optim_rng.pt`, one flat tensor per buffer and state with the buckets' end padding cut out
      (`{"buckets_coalesced": True, b: {dtypes: {"param": ..., ...}}}`, megatron-core since Feb 2024;
      `RankBuckets`).

Which parameter sits where depends on the layer spec's registration order (Transformer Engine's differs
from the local spec's), which neither records. So it is read off the values: a parameter's master
weight, rounded to the model's dtype, is the saved weight exactly (megatron-core copies the masters into
the weights after every step), and after each parameter the next one is looked for at the next multiple
of 64, or right at its end (a bucket boundary with the padding cut out). Anything else - no parameter
matching, two with the same values, a buffer not covered to its end, a parameter in no buffer - is a
`PlacementError`, and the caller converts the weights without the optimizer state, saying why.
"""

from __future__ import annotations

import bisect
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatron_ds.interop.megatron_lm_files import DistTensors, MegatronLMCheckpoint, RankTensors, load_pickled_state

ALIGN = 64
"""megatron-core pads each parameter's start in the buffer to a multiple of 64 elements."""
SHARDING_TYPES = ("dp_reshardable", "fully_sharded_bucket_space")
"""torch_dist's name for the format in megatron-core 0.14 and later, and before."""
GATHERED = "dp_zero_gather_scatter"
"""torch_dist's name for the per-rank pickled buffers (megatron-core 0.5-0.6's default)."""
RANK_FILE = "distrib_optim.pt"
_BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_.*\.bucket_idx_(\d+)\.param$")
_PARAM_STATE = re.compile(r"optimizer\.distributed\.dp_group_idx_\d+\.param_state/")
_GROUP_OPTIMIZER = re.compile(r"optimizer\.distributed\.dp_group_idx_\d+\.optimizer/")
SWIGLU_FC1 = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")
STATES = ("param", "exp_avg", "exp_avg_sq")


class PlacementError(ValueError):
    """The buffers do not match the model's tensors (the reason, one line)."""


@dataclass(frozen=True)
class Piece:
    """One rank's parameter and where its saved weight is."""

    key: str
    """The stored tensor's name."""
    where: tuple
    """torch_dist: the (offsets, sizes) of its chunks of `key`, in the parameter's element order; torch:
    (stage, tensor rank)."""
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class Placement:
    buffer: str
    """The flat tensor's name without the state."""
    start: int


class Flat(Protocol):
    numel: int

    def get(self, start: int, stop: int) -> torch.Tensor: ...


def place(
    buffers: dict[str, Flat], pieces: list[Piece], values: Callable[[Piece], torch.Tensor]
) -> dict[Piece, Placement]:
    """Where each of `pieces` (the parameters of the ranks `buffers` hold) starts in `buffers` (their fp32
    masters, by name), found by value; the first place of a parameter several buffers hold (a replicated
    norm on every tensor rank)."""
    index: dict[tuple[torch.dtype, float], list[Piece]] = {}
    for piece in pieces:
        index.setdefault((piece.dtype, values(piece)[0].item()), []).append(piece)
    dtypes = {dtype for dtype, _ in index}
    placed: dict[Piece, Placement] = {}
    for name, flat in buffers.items():
        for piece, start in _scan(name, flat, index, dtypes, values):
            placed.setdefault(piece, Placement(name, start))
    missing = [p.key for p in pieces if p not in placed]
    if missing:
        raise PlacementError(f"no buffer holds the optimizer state of {missing[0]}")
    return placed


def _scan(
    name: str, flat: Flat, index: dict, dtypes: set[torch.dtype], values: Callable[[Piece], torch.Tensor]
) -> Iterable[tuple[Piece, int]]:
    end, last, origin, here = flat.numel, 0, 0, set()
    while last < end:
        aligned = origin + -(-(last - origin) // ALIGN) * ALIGN  # starts align from the bucket's start
        found: set[Piece] = set()
        for start in dict.fromkeys((aligned, last)):  # aligned, then where a bucket's end padding was cut out
            found = _found(flat, start, index, dtypes, values, here) if start < end else set()
            if found:
                origin = start if start != aligned else origin
                break
        if len(found) != 1:
            what = "no model tensor's" if not found else f"{len(found)} model tensors' ({_names(found)})"
            raise PlacementError(f"{name}: {what} weights equal its fp32 master weights at element {aligned}")
        piece = found.pop()
        here.add(piece)
        yield piece, start
        last = start + piece.numel
    if last != end:
        raise PlacementError(f"{name}: its parameters end at element {last}, the buffer at {end}")


def _found(
    flat: Flat, start: int, index: dict, dtypes: set, values: Callable[[Piece], torch.Tensor], here: set
) -> set[Piece]:
    probe = flat.get(start, start + 1)
    return {
        piece
        for dtype in dtypes
        for piece in index.get((dtype, probe.to(dtype).item()), ())
        if piece not in here
        and start + piece.numel <= flat.numel
        and torch.equal(flat.get(start, start + piece.numel).to(piece.dtype), values(piece))
    }


def _names(pieces: set[Piece]) -> str:
    return ", ".join(sorted({p.key for p in pieces}))


# ----- torch_dist: dp_reshardable buckets --------------------------------------------------------


def optimizer_step(dist: DistTensors) -> set[float]:
    """The `step` of every param group every model-parallel rank saved."""
    steps: set[float] = set()
    for name in dist.objects:
        if _GROUP_OPTIMIZER.match(name):
            saved = dist.read_object(name)
            for group in saved if isinstance(saved, list) else [saved]:
                groups = group.get("param_groups") if isinstance(group, dict) else None
                steps |= {float(g["step"]) for g in groups or [] if isinstance(g, dict) and "step" in g}
    return steps


class DistBuckets:
    """A torch_dist checkpoint's buffers, each model tensor's chunks placed in them: dp_reshardable's buckets
    (sharded tensors) or, with `gathered`, dp_zero_gather_scatter's (megatron-core 0.5-0.6's default: per
    model-parallel rank a pickled `param_state` holding what `distrib_optim.pt` holds)."""

    def __init__(self, dist: DistTensors, model_keys: list[str], swiglu: bool, gathered: bool = False) -> None:
        self.dist = dist
        self.pieces = {key: _pieces(dist, key, swiglu and key.endswith(SWIGLU_FC1)) for key in model_keys}
        self.states = _gathered_buffers(dist) if gathered else _bucket_buffers(dist)
        """Each buffer's flat state tensors (`param`, `exp_avg`, `exp_avg_sq`) by name."""
        buffers = {name: flats("param") for name, flats in self.states.items()}
        self.placed = place(buffers, [p for ps in self.pieces.values() for p in ps], self._values)

    def read(self, key: str, state: str, layer: int | None = None) -> torch.Tensor:
        """State `state` (`param`: the fp32 master; `exp_avg`, `exp_avg_sq`) of stored model tensor `key`
        (its slice `layer` on dim 0 when given), in the stored tensor's layout, fp32."""
        size = self.dist.shape(key)
        out = torch.empty(size if layer is None else size[1:], dtype=torch.float32)
        for piece in self.pieces[key]:
            if layer is not None and not any(o[0] <= layer < o[0] + s[0] for o, s in piece.where):
                continue
            where = self.placed[piece]
            flat = self.states[where.buffer](state).get(where.start, where.start + piece.numel)
            position = 0
            for offsets, sizes in piece.where:
                block = flat[position : position + math.prod(sizes)].view(sizes)
                position += math.prod(sizes)
                if layer is not None:
                    if not offsets[0] <= layer < offsets[0] + sizes[0]:
                        continue
                    block, offsets, sizes = block[layer - offsets[0]], offsets[1:], sizes[1:]
                out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = block
        return out

    def _values(self, piece: Piece) -> torch.Tensor:
        return torch.cat([self.dist.chunk(piece.key, o, s).reshape(-1) for o, s in piece.where])


def _bucket_buffers(dist: DistTensors) -> dict[str, Callable[[str], Flat]]:
    names = sorted((_bucket_order(k), k[: -len(".param")]) for k in dist.tensors if _BUCKET.match(k))
    if not names:
        raise PlacementError("it holds no bucket of fp32 master weights")
    return {name: lambda state, name=name: _DistFlat(dist, f"{name}.{state}") for _, name in names}


def _gathered_buffers(dist: DistTensors) -> dict[str, Callable[[str], Flat]]:
    out: dict[str, Callable[[str], Flat]] = {}
    for name in sorted(n for n in dist.objects if _PARAM_STATE.match(n)):
        saved = dist.read_object(name)
        for buffer, states in _coalesced(saved[0] if isinstance(saved, list) and saved else saved, name).items():
            out[buffer] = lambda state, states=states: _TensorFlat(states[state])
    if not out:
        raise PlacementError("it holds no param_state of the distributed optimizer")
    return out


def _bucket_order(key: str) -> tuple[int, int, int]:
    match = _BUCKET.match(key)
    assert match is not None
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def _pieces(dist: DistTensors, key: str, swiglu: bool) -> list[Piece]:
    """The parameters stored tensor `key` is saved from: one per chunk, except SwiGLU's fc1, whose rank
    parameter [gate rows; up rows] is saved as two chunks of the [all gate; all up] tensor
    (megatron-core's `apply_swiglu_sharded_factory`)."""
    meta = dist.tensors[key]
    dtype = meta.properties.dtype
    chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks)
    if not swiglu:
        return [Piece(key, (c,), dtype, math.prod(c[1])) for c in chunks]
    rows = 1 if len(meta.size) > (2 if key.endswith("weight") else 1) else 0  # dim 0 is the layer when stacked
    half = meta.size[rows] // 2
    gates = [c for c in chunks if c[0][rows] < half]
    ups = {_shifted(c[0], rows, -half): c for c in chunks if c[0][rows] >= half}
    if len(gates) != len(ups) or any(g[0] not in ups for g in gates):
        raise PlacementError(f"{key}: its gate and up chunks do not pair")
    return [Piece(key, (g, ups[g[0]]), dtype, 2 * math.prod(g[1])) for g in gates]


def _shifted(offsets: tuple[int, ...], dim: int, by: int) -> tuple[int, ...]:
    return offsets[:dim] + (offsets[dim] + by,) + offsets[dim + 1 :]


class _DistFlat:
    """A 1-D stored tensor, read by element range (only the chunks a range touches)."""

    def __init__(self, dist: DistTensors, key: str) -> None:
        self.dist, self.key = dist, key
        meta = dist.tensors[key]
        self.numel = int(meta.size[0])
        self.chunks = sorted((int(c.offsets[0]), int(c.sizes[0])) for c in meta.chunks)
        self.starts = [o for o, _ in self.chunks]
        self._last: tuple[int, torch.Tensor] | None = None
        """The chunk read last (a probe's chunk is the match's first)."""

    def get(self, start: int, stop: int) -> torch.Tensor:
        out = torch.empty(stop - start, dtype=self.dist.tensors[self.key].properties.dtype)
        i = max(bisect.bisect_right(self.starts, start) - 1, 0)
        position = start
        while position < stop:
            if i >= len(self.chunks) or self.chunks[i][0] > position:
                raise PlacementError(f"{self.key}: no stored chunk holds element {position}")
            offset, size = self.chunks[i]
            if self._last is None or self._last[0] != offset:
                self._last = offset, self.dist.chunk(self.key, (offset,), (size,))
            blob = self._last[1]
            take = min(stop, offset + size) - position
            out[position - start : position - start + take] = blob[position - offset : position - offset + take]
            position += take
            i += 1
        return out


# ----- torch: distrib_optim.pt per rank ----------------------------------------------------------


class _TensorFlat:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.numel = tensor, tensor.numel()

    def get(self, start: int, stop: int) -> torch.Tensor:
        return self.tensor[start:stop]


class RankBuckets:
    """A `--ckpt-format torch` checkpoint's `distrib_optim.pt` files, each rank's parameters placed in its own."""

    def __init__(self, ckpt: MegatronLMCheckpoint, ranks: RankTensors, ignored: tuple[str, ...]) -> None:
        self.ranks = ranks
        self.saved: dict[tuple[int, int], dict[str, dict[str, torch.Tensor]]] = {}
        self.placed: dict[Piece, Placement] = {}
        for stage in range(ckpt.pipeline_parallel):
            for rank in range(ckpt.tensor_parallel):
                path = os.path.join(os.path.dirname(ckpt.rank_file(rank, stage)), RANK_FILE)
                buffers = self.saved[stage, rank] = _coalesced(load_pickled_state(path), path)
                model = ranks.model(rank, stage)
                pieces = [
                    Piece(k, (stage, rank), v.dtype, v.numel())
                    for k, v in model.items()
                    if isinstance(v, torch.Tensor) and not k.endswith(ignored)
                ]
                flats: dict[str, Flat] = {name: _TensorFlat(states["param"]) for name, states in buffers.items()}
                self.placed |= place(
                    flats, pieces, lambda p: self.ranks.model(p.where[1], p.where[0])[p.key].reshape(-1)
                )

    def shard(self, stage: int, rank: int, key: str, state: str) -> torch.Tensor:
        """State `state` of tensor rank `rank`'s `key` on `stage`, in its local shape, fp32."""
        weight = self.ranks.model(rank, stage)[key]
        where = self.placed[Piece(key, (stage, rank), weight.dtype, weight.numel())]
        flat = self.saved[stage, rank][where.buffer][state]
        return flat[where.start : where.start + weight.numel()].view(weight.shape).float()


def _coalesced(saved: Any, path: str) -> dict[str, dict[str, torch.Tensor]]:
    """megatron-core's `get_parameter_state_dp_zero` output (`distrib_optim.pt`, or dp_zero_gather_scatter's
    pickled param_state; `path`: where it was read) as flat states by buffer (`<path> buffer <b>`)."""
    if not isinstance(saved, dict) or saved.get("buckets_coalesced") is not True:
        raise PlacementError(f"{path} is in megatron-core's layout of before February 2024 (no buckets_coalesced)")
    buffers = {}
    for b, by_dtype in saved.items():
        if b == "buckets_coalesced":
            continue
        if not isinstance(by_dtype, dict) or len(by_dtype) != 1:
            raise PlacementError(f"{path}: buffer {b} is not one dtype's states")
        states = next(iter(by_dtype.values()))
        if not isinstance(states, dict) or any(not isinstance(states.get(s), torch.Tensor) for s in STATES):
            raise PlacementError(f"{path}: buffer {b} lacks one of {', '.join(STATES)}")
        buffers[f"{path} buffer {b}"] = states
    return buffers
