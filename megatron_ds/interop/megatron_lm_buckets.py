"""Adam's state from the distributed optimizer's `dp_reshardable` buffers of a Megatron-LM torch_dist
checkpoint (megatron-core's default `distrib_optim_sharding_type`; `fully_sharded_bucket_space` in
releases before 0.14), named by model tensor. Pure reading; nothing of Megatron is imported.

What upstream saves (megatron-core 0.16 `DistributedOptimizer.sharded_param_state_dp_reshardable`): per
model-parallel rank g, gradient buffer b (one per parameter dtype) and bucket k, one flat tensor per state,
`optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_<dtypes>.bucket_idx_<k>.<param|exp_avg|
exp_avg_sq>`, holding the bucket as the buffer lays it out (`_ParamAndGradBuffer`): the rank's parameters
in reverse registration order, each starting at a multiple of 64 elements, up to the last parameter's end
(the padding to the data-parallel multiple is left out, so the tensor does not depend on d). `param` is
the fp32 master weight.

Which parameter sits where depends on the layer spec's registration order (Transformer Engine's differs
from the local spec's), which the checkpoint does not record. So it is read off the values: a
parameter's master weight, rounded to the model's dtype, is the saved weight exactly (megatron-core
copies the masters into the weights after every step), and each of a rank's parameters (a stored chunk
of a model tensor; for SwiGLU's fc1 under tensor parallelism its rank's gate and up chunks together) is
looked for at each 64-aligned start in turn. Anything else - no match, two tensors with the same values,
a bucket not covered to its end, a model tensor not found - is a `PlacementError`, and the caller converts
the weights without the optimizer state, saying why.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass

import torch

from megatron_ds.interop.megatron_lm_files import DistTensors

ALIGN = 64
"""megatron-core pads each parameter's start in the buffer to a multiple of 64 elements."""
PREFIX = "optimizer.distributed."
SHARDING_TYPES = ("dp_reshardable", "fully_sharded_bucket_space")
"""The format's name in megatron-core 0.14 and later, and before."""
_BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_.*\.bucket_idx_(\d+)\.param$")
_GROUP_OPTIMIZER = re.compile(r"optimizer\.distributed\.dp_group_idx_\d+\.optimizer/")
SWIGLU_FC1 = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")


class PlacementError(ValueError):
    """The buckets do not match the model's tensors (the reason, one line)."""


@dataclass(frozen=True)
class Piece:
    """One rank's parameter: chunks of stored model tensor `key`, in the parameter's element order."""

    key: str
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    """(offsets, sizes) of each chunk in the stored tensor."""
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(math.prod(sizes) for _, sizes in self.chunks)


@dataclass(frozen=True)
class Placement:
    bucket: str
    """The bucket's key without the state (`...bucket_idx_<k>`)."""
    start: int


def has_buckets(dist: DistTensors) -> bool:
    return any(_BUCKET.match(k) for k in dist.tensors)


def optimizer_step(dist: DistTensors) -> set[float]:
    """The `step` of every param group every model-parallel rank saved."""
    steps: set[float] = set()
    for name in dist.objects:
        if _GROUP_OPTIMIZER.match(name):
            for saved in _as_list(dist.read_object(name)):
                groups = saved.get("param_groups") if isinstance(saved, dict) else None
                steps |= {float(g["step"]) for g in groups or [] if isinstance(g, dict) and "step" in g}
    return steps


def _as_list(value: object) -> list:
    return value if isinstance(value, list) else [value]


class BucketStates:
    """Where each model tensor's chunks are in the buckets, and its states read from there."""

    def __init__(self, dist: DistTensors, model_keys: list[str], swiglu: bool) -> None:
        self.dist = dist
        self.pieces = {key: _pieces(dist, key, swiglu and key.endswith(SWIGLU_FC1)) for key in model_keys}
        self.placed: dict[Piece, Placement] = {}
        self._locate()

    # ----- reading states ----------------------------------------------------------------------

    def read(self, key: str, state: str, layer: int | None = None) -> torch.Tensor:
        """State `state` (`param`: the fp32 master; `exp_avg`, `exp_avg_sq`) of stored model tensor `key`
        (its slice `layer` on dim 0 when given), in the stored tensor's layout, fp32."""
        size = self.dist.shape(key)
        out = torch.empty(size if layer is None else size[1:], dtype=torch.float32)
        for piece in self.pieces[key]:
            chunks = [(o, s) for o, s in piece.chunks if layer is None or o[0] <= layer < o[0] + s[0]]
            if not chunks:
                continue
            where = self.placed[piece]
            flat = _Flat(self.dist, f"{where.bucket}.{state}").get(where.start, where.start + piece.numel)
            position = 0
            for offsets, sizes in piece.chunks:
                n = math.prod(sizes)
                block = flat[position : position + n].view(sizes)
                position += n
                if (offsets, sizes) not in chunks:
                    continue
                if layer is not None:
                    block, offsets, sizes = block[layer - offsets[0]], offsets[1:], sizes[1:]
                out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = block
        return out

    # ----- finding the parameters ------------------------------------------------------------------

    def _locate(self) -> None:
        index: dict[tuple[torch.dtype, float], list[Piece]] = {}
        for pieces in self.pieces.values():
            for piece in pieces:
                first = _values(self.dist, piece)[0].item()
                index.setdefault((piece.dtype, first), []).append(piece)
        dtypes = {dtype for dtype, _ in index}
        buckets = sorted((_bucket_order(k), k[: -len(".param")]) for k in self.dist.tensors if _BUCKET.match(k))
        if not buckets:
            raise PlacementError("it holds no dp_reshardable bucket of fp32 master weights")
        for _, bucket in buckets:
            self._scan(bucket, index, dtypes)
        missing = [p.key for pieces in self.pieces.values() for p in pieces if p not in self.placed]
        if missing:
            raise PlacementError(f"no bucket holds the optimizer state of {missing[0]}")

    def _scan(self, bucket: str, index: dict, dtypes: set[torch.dtype]) -> None:
        flat = _Flat(self.dist, f"{bucket}.param")
        end, start, last, here = flat.numel, 0, 0, set()
        while start < end:
            probe = flat.get(start, start + 1)
            found = {
                piece
                for dtype in dtypes
                for piece in index.get((dtype, probe.to(dtype).item()), ())
                if piece not in here and start + piece.numel <= end and _matches(self.dist, piece, flat, start)
            }
            if len(found) != 1:
                what = "no model tensor's" if not found else f"{len(found)} model tensors' ({_names(found)})"
                raise PlacementError(f"{bucket}: {what} weights equal its fp32 master weights at element {start}")
            piece = found.pop()
            here.add(piece)
            self.placed.setdefault(piece, Placement(bucket, start))
            last = start + piece.numel
            start = -(-last // ALIGN) * ALIGN
        if last != end:
            raise PlacementError(f"{bucket}: its parameters end at element {last}, the bucket at {end}")


def _bucket_order(key: str) -> tuple[int, int, int]:
    match = _BUCKET.match(key)
    assert match is not None
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def _names(pieces: set[Piece]) -> str:
    return ", ".join(sorted({p.key for p in pieces}))


def _matches(dist: DistTensors, piece: Piece, flat: _Flat, start: int) -> bool:
    masters = flat.get(start, start + piece.numel)
    return torch.equal(masters.to(piece.dtype), _values(dist, piece))


def _values(dist: DistTensors, piece: Piece) -> torch.Tensor:
    return torch.cat([dist.chunk(piece.key, o, s).reshape(-1) for o, s in piece.chunks])


def _pieces(dist: DistTensors, key: str, swiglu: bool) -> list[Piece]:
    """The parameters stored tensor `key` is saved from: one per chunk, except SwiGLU's fc1, whose rank
    parameter [gate rows; up rows] is saved as two chunks of the [all gate; all up] tensor
    (megatron-core's `apply_swiglu_sharded_factory`)."""
    meta = dist.tensors[key]
    dtype = meta.properties.dtype
    chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks)
    if not swiglu:
        return [Piece(key, (c,), dtype) for c in chunks]
    rows = 1 if len(meta.size) > (2 if key.endswith("weight") else 1) else 0  # dim 0 is the layer when stacked
    half = meta.size[rows] // 2
    gates = [c for c in chunks if c[0][rows] < half]
    ups = {_shifted(c[0], rows, -half): c for c in chunks if c[0][rows] >= half}
    if len(gates) != len(ups) or any(g[0] not in ups for g in gates):
        raise PlacementError(f"{key}: its gate and up chunks do not pair")
    return [Piece(key, (g, ups[g[0]]), dtype) for g in gates]


def _shifted(offsets: tuple[int, ...], dim: int, by: int) -> tuple[int, ...]:
    return offsets[:dim] + (offsets[dim] + by,) + offsets[dim + 1 :]


class _Flat:
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
