"""Measured per-rank memory: parameters, gradients, optimizer state, and peak saved activations.

How it is measured (no estimates):
- parameters: the bytes of every parameter storage of this rank's module.
- gradients: the bytes of every gradient tensor alive just before the optimizer step (module
  parameters' `.grad`, the optimizer's own parameters' `.grad`, and gradient buffers an optimizer
  wrapper keeps, such as DeepSpeed's bf16 fp32 gradient accumulators), taken by a step pre-hook.
- optimizer: every other tensor reachable from the optimizer objects (Adam moments, fp32 master
  copies, ZeRO partitions, flat buffers), deduplicated by storage and excluding parameters.
- activations: the peak of tensors saved for backward across a whole `train_batch` (all
  micro-batches in flight under the 1F1B schedule), counted through
  `torch.autograd.graph.saved_tensors_hooks` by storage, excluding parameters.
On GPU, torch.cuda's allocated / max allocated / reserved are reported too.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional

import torch

MB = 1024.0 * 1024.0


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())


def _param_keys(module: torch.nn.Module) -> set[tuple[int, int]]:
    return {_storage_key(p) for p in module.parameters()}


def _tensors(obj: Any, path: str, depth: int, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
        if obj.grad is not None:
            yield path + ".grad", obj.grad
    elif isinstance(obj, dict):
        for k, v in obj.items():
            label = k if isinstance(k, (str, int)) else type(k).__name__  # never a tensor's repr
            yield from _tensors(v, f"{path}[{label}]", depth - 1, seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]", depth - 1, seen)
    elif isinstance(obj, torch.optim.Optimizer) or hasattr(obj, "param_groups"):
        yield from _tensors(obj.state if isinstance(obj, torch.optim.Optimizer) else {}, path + ".state",
                            depth - 1, seen)
        yield from _tensors(obj.param_groups, path + ".param_groups", depth - 1, seen)
        for k, v in vars(obj).items():
            if isinstance(v, (torch.Tensor, dict, list, tuple, torch.optim.Optimizer)):
                yield from _tensors(v, f"{path}.{k}", depth - 1, seen)


@dataclass
class GradProbe:
    """Gradient bytes alive at the optimizer step (the step pre-hook fills `bytes`)."""

    bytes: int = 0
    _handle: Any = field(default=None, repr=False)


def install_grad_probe(engine: Any) -> GradProbe:
    """Measure gradient bytes at each optimizer step (hook on the optimizer DeepSpeed steps)."""
    probe = GradProbe()
    module_keys = _param_keys(engine.module)

    def measure(*_: Any) -> None:
        seen: dict[tuple[int, int], int] = {}
        for p in engine.module.parameters():
            if p.grad is not None:
                seen[_storage_key(p.grad)] = p.grad.untyped_storage().nbytes()
        for path, t in _tensors(engine.optimizer, "opt", 5, set()):
            key = _storage_key(t)
            if "grad" in path.lower() and key not in module_keys:
                seen[key] = t.untyped_storage().nbytes()
        probe.bytes = max(probe.bytes, sum(seen.values()))

    basic = getattr(engine, "basic_optimizer", None) or engine.optimizer
    probe._handle = basic.register_step_pre_hook(measure)
    return probe


def optimizer_bytes(engine: Any) -> int:
    """Bytes of optimizer-held tensors that are neither parameters nor gradients."""
    module_keys = _param_keys(engine.module)
    seen: dict[tuple[int, int], int] = {}
    for root in (engine.optimizer, getattr(engine, "basic_optimizer", None)):
        if root is None:
            continue
        for path, t in _tensors(root, "opt", 5, set()):
            key = _storage_key(t)
            if key not in module_keys and "grad" not in path.lower() and t.numel() > 0:
                seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


class ActivationPeak:
    """Peak bytes of tensors saved for backward while `track()` is active."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.param_keys = _param_keys(module)
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

    @contextmanager
    def track(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@dataclass
class RankMemory:
    """One rank's measured memory, in bytes."""

    rank: int
    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int
    cuda: Optional[dict[str, float]] = None

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def format(self, iteration: int) -> str:
        line = (f"[Rank {self.rank} | stage {self.stage}] (after {iteration} iterations) memory (MB) | "
                f"params: {self.params / MB:.2f} | grads: {self.grads / MB:.2f} | "
                f"optimizer: {self.optimizer / MB:.2f} | activations (peak saved): {self.activations / MB:.2f} | "
                f"total: {self.total / MB:.2f}")
        if self.cuda:
            line += " | " + " | ".join(f"{k}: {v:.1f}" for k, v in self.cuda.items())
        return line


def measure(engine: Any, probe: GradProbe, activations: ActivationPeak, rank: int, stage: int) -> RankMemory:
    params = sum(s for s in {_storage_key(p): p.untyped_storage().nbytes()
                             for p in engine.module.parameters()}.values())
    cuda = None
    if torch.cuda.is_available():
        cuda = {"allocated": torch.cuda.memory_allocated() / MB, "max allocated": torch.cuda.max_memory_allocated() / MB,
                "reserved": torch.cuda.memory_reserved() / MB, "max reserved": torch.cuda.max_memory_reserved() / MB}
    return RankMemory(rank, stage, params, probe.bytes, optimizer_bytes(engine), activations.peak, cuda)


def gather_report(mem: RankMemory) -> list[RankMemory]:
    """Every rank's measurement, on every rank (one all_gather_object)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, asdict(mem))
    return [RankMemory(**d) for d in out]
