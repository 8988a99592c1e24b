"""Measured per-rank memory of one `train_batch`: model states, saved activations and the true peak.

`StepMeter.measure()` wraps the one reported `train_batch` (`warm_up()` the step before it; no
other step is profiled) and measures on this rank's device, with no estimate anywhere:

- params: the bytes of every parameter storage of this rank's module, ZeRO-3's partitions included
  (and its persistent tensors, which it keeps whole besides).
- grads: the bytes of every gradient tensor alive just before the optimizer step (parameters'
  `.grad` and the optimizer wrapper's gradient buffers, such as ZeRO's flat fp32 partition
  gradient), read by a step pre-hook.
- optimizer: every other tensor reachable from the optimizer objects (Adam moments and step
  counters, fp32 master copies, ZeRO partitions), by storage, parameters excluded.
- activations: the peak of tensors saved for backward across the whole step (all micro-batches in
  flight under DeepSpeed's 1F1B schedule), by storage, through
  `torch.autograd.graph.saved_tensors_hooks`, parameters excluded, and the inputs DeepSpeed's
  activation checkpointing keeps for its recompute (`saved_activations.ActivationPeak`).
- peak (the total): the most the rank holds at any moment of the step. On CPU: the tensor storages
  alive when the step starts (a scan of the garbage collector's objects) plus the running sum of
  every allocation and free of the CPU allocator during the step, from torch.profiler's memory
  events (`allocation_trace.CpuAllocationTrace` says how its blind spots are closed). On CUDA:
  torch.cuda's max allocated over the step; allocated / max allocated / reserved are printed too.
- host: of params + grads + optimizer, what ZeRO offload keeps in host memory (by owner, so that a CPU
  run reports what a GPU run would move: `RankMemory.host`).
- other: peak - (params + grads + optimizer + activations): pipe buffers (received activations,
  outputs kept until their backward, the last stage's fp32 logits), short-lived buffers (loss
  gradients, a weight gradient before accumulation, the gradient all-reduce's flat copy, the
  optimizer's temporaries). The components peak at different moments (no gradient exists while
  the first micro-batches' activations pile up), so `other` is a remainder and can be negative.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch

from megatron_ds.training.measure.allocation_trace import CpuAllocationTrace, CudaAllocationTrace
from megatron_ds.training.measure.saved_activations import ActivationPeak, param_keys

MB = 1024.0 * 1024.0


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())


def _param_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Every parameter's data and, under ZeRO-3, its partition (`ds_tensor`, a view of the flat buffer)."""
    for p in module.parameters():
        yield p
        partition = getattr(p, "ds_tensor", None)
        if partition is not None:
            yield partition


def _param_keys(module: torch.nn.Module) -> set[tuple[int, int]]:
    return param_keys(module)


def _tensors(obj: Any, path: str, depth: int, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor reachable from an optimizer object, its state and its attributes."""
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta":  # ZeRO keeps meta-device shadows of its parameters: no memory
            yield path, obj
        if obj.is_leaf and obj.grad is not None:
            yield path + ".grad", obj.grad
    elif isinstance(obj, dict):
        for k, v in obj.items():
            label = k if isinstance(k, (str, int)) else type(k).__name__  # never a tensor's repr
            yield from _tensors(v, f"{path}[{label}]", depth - 1, seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]", depth - 1, seen)
    elif isinstance(obj, torch.optim.Optimizer) or hasattr(obj, "param_groups"):
        yield from _tensors(
            obj.state if isinstance(obj, torch.optim.Optimizer) else {}, path + ".state", depth - 1, seen
        )
        yield from _tensors(obj.param_groups, path + ".param_groups", depth - 1, seen)
        for k, v in vars(obj).items():
            if isinstance(v, (torch.Tensor, dict, list, tuple, torch.optim.Optimizer)):
                yield from _tensors(v, f"{path}.{k}", depth - 1, seen)


def _is_gradient(path: str) -> bool:
    """A gradient buffer by its name (`.grad`, `averaged_gradients`, ...), not a gradient norm."""
    return re.search(r"grad(?!_norm)", path.lower()) is not None


def _optimizer_roots(engine: Any) -> list[Any]:
    return [r for r in (engine.optimizer, getattr(engine, "basic_optimizer", None)) if r is not None]


def gradient_bytes(engine: Any, optimizer_held_only: bool = False) -> int:
    """Bytes of gradient tensors alive now: module `.grad`s and gradient buffers the optimizer holds (only
    the latter with `optimizer_held_only`: what ZeRO's optimizer offload keeps on the host)."""
    module_keys = _param_keys(engine.module)
    seen: dict[tuple[int, int], int] = {}
    for p in engine.module.parameters():
        if p.grad is not None and not optimizer_held_only:
            seen[_storage_key(p.grad)] = p.grad.untyped_storage().nbytes()
    for root in _optimizer_roots(engine):
        for path, t in _tensors(root, "opt", 5, set()):
            key = _storage_key(t)
            if optimizer_held_only and "for_gpu_offload" in path:
                continue  # the offloaded optimizer's device-side staging buffer
            if _is_gradient(path) and key not in module_keys:
                seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


def optimizer_bytes(engine: Any, host_only: bool = False) -> int:
    """Bytes of optimizer-held tensors that are neither parameters nor gradients (`host_only`: without the
    device-side staging buffer of DeepSpeed's offloaded ZeRO-1/2 optimizer, `temp_grad_buffer_for_gpu_offload`)."""
    module_keys = _param_keys(engine.module)
    seen: dict[tuple[int, int], int] = {}
    for root in _optimizer_roots(engine):
        for path, t in _tensors(root, "opt", 5, set()):
            key = _storage_key(t)
            device_side = host_only and "for_gpu_offload" in path
            if key not in module_keys and not _is_gradient(path) and t.numel() > 0 and not device_side:
                seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


def parameter_bytes(module: torch.nn.Module, partitions_only: bool = False) -> int:
    """Bytes of the module's parameter storages (a flat buffer shared by views counted once), ZeRO-3's
    partitions included (only those with `partitions_only`)."""
    tensors = (
        (getattr(p, "ds_tensor", None) for p in module.parameters()) if partitions_only else _param_tensors(module)
    )
    return sum({_storage_key(t): t.untyped_storage().nbytes() for t in tensors if t is not None}.values())


def offloaded(engine: Any) -> tuple[bool, bool]:
    """(optimizer, parameters): which model states this engine's ZeRO keeps in host memory."""
    optimizer = getattr(engine, "zero_offload_optimizer", lambda: None)()
    param = getattr(engine, "zero_offload_param", lambda: None)()
    return (
        optimizer is not None and str(optimizer.device) != "none",
        param is not None and str(param.device) != "none",
    )


def live_storages(engine: Any, device: torch.device) -> dict[int, int]:
    """Address -> bytes of every distinct tensor storage on `device` alive now.

    Tensors with a Python object are found through `gc.get_objects()`; gradients and optimizer
    tensors that may exist only on the C++ side are added from the module and the optimizer.
    """
    seen: dict[int, int] = {}

    def add(t: torch.Tensor | None) -> None:
        if t is None or t.device != device or t.layout != torch.strided:
            return
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()

    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads obj.__class__, which some module proxies warn on.
        if issubclass(type(obj), torch.Tensor):
            add(obj)
            if obj.is_leaf:  # .grad of a non-leaf warns and is always None
                add(obj.grad)
    for p in engine.module.parameters():
        add(p)
        add(p.grad)
    for root in _optimizer_roots(engine):
        for _, t in _tensors(root, "opt", 5, set()):
            add(t)
    return seen


@dataclass
class RankMemory:
    """One rank's measured memory of one train_batch, in bytes."""

    rank: int
    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int
    peak: int
    """The most the rank held at once during the step."""
    held_at_start: int = 0
    """Held when the step started (CPU: tensor storages; CUDA: torch.cuda's allocated)."""
    held_at_end: int = 0
    inferred_frees: int = 0
    """Blocks freed on a thread the trace does not see (see allocation_trace.CpuAllocationTrace)."""
    unseen_frees: int = 0
    """Bytes allocated before the trace and freed unseen during the step: the measurement's error
    bound (the peak may be too high by at most this much); 0 when the warm-up worked."""
    cuda: dict[str, float] | None = None
    host: int = 0
    """Of params + grads + optimizer, the bytes ZeRO offload keeps in host memory: the optimizer's tensors
    (its fp32 masters, states and gradient partitions) with offload_optimizer, the parameter partitions
    with offload_param. By owner, not by device, so that a CPU run reports what a GPU run would move."""

    @property
    def total(self) -> int:
        return self.peak

    @property
    def other(self) -> int:
        """Pipe buffers, transients and anything else at the peak (a remainder, see the module docstring)."""
        return self.peak - (self.params + self.grads + self.optimizer + self.activations)

    def format(self, iteration: int) -> str:
        line = (
            f"[Rank {self.rank} | stage {self.stage}] (after {iteration} iterations) memory (MB) | "
            f"params: {self.params / MB:.2f} | grads: {self.grads / MB:.2f} | "
            f"optimizer: {self.optimizer / MB:.2f} | activations (peak saved): {self.activations / MB:.2f} | "
            f"other (buffers, transients): {self.other / MB:.2f} | total (measured peak): {self.peak / MB:.2f}"
        )
        if self.host:
            line += f" | of the model states offloaded to host: {self.host / MB:.2f}"
        if self.unseen_frees >= 0.005 * MB:
            line += f" | unseen frees (peak may be this much too high): {self.unseen_frees / MB:.2f}"
        if self.cuda:
            line += " | " + " | ".join(f"{k}: {v:.1f}" for k, v in self.cuda.items())
        return line


class StepMeter:
    """Measures one `train_batch` of a DeepSpeed engine.

        with meter.warm_up():   # optional, the step before: starts the allocation trace
            engine.train_batch(...)
        with meter.measure():   # the measured step
            engine.train_batch(...)
        meter.result(rank, stage)

    Without `warm_up()` the measured step must be the first of the process (nothing left over from
    an earlier step), or the peak counts blocks that the step frees as still alive.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.device = next(engine.module.parameters()).device
        self.grads = self.host_grads = 0
        self.activations = ActivationPeak(engine.module)
        self.trace = CudaAllocationTrace() if self.device.type == "cuda" else CpuAllocationTrace()
        self.measured = False

    def _on_step(self, *_: Any) -> None:
        self.grads = max(self.grads, gradient_bytes(self.engine))
        if offloaded(self.engine)[0]:
            self.host_grads = max(self.host_grads, gradient_bytes(self.engine, optimizer_held_only=True))

    def _held(self) -> dict[int, int]:
        if self.device.type == "cuda":
            return {0: torch.cuda.memory_allocated()}
        return live_storages(self.engine, self.device)

    @contextmanager
    def warm_up(self) -> Iterator[None]:
        """Wrap the step before the measured one (the trace then sees its leftovers freed)."""
        self.trace.start()
        try:
            yield
        except BaseException:
            self.trace.stop()
            raise

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Wrap exactly one train_batch (the profiler slows it down; do not wrap every step)."""
        basic = getattr(self.engine, "basic_optimizer", None) or self.engine.optimizer
        handle = basic.register_step_pre_hook(self._on_step)
        if not self.trace.started:
            self.trace.start()
        at_start, at_end = self._held(), None
        try:
            with self.activations.track(), self.trace.window():
                yield
            at_end = self._held()
        finally:
            handle.remove()
            self.trace.stop(at_start, at_end)
        self.measured = True

    def result(self, rank: int, stage: int) -> RankMemory:
        """The measurement of the wrapped step (model states are read now, after it)."""
        if not self.measured:
            raise RuntimeError("StepMeter.result() before a step was measured: wrap a train_batch in measure()")
        cuda = None
        if self.device.type == "cuda":
            cuda = {
                "allocated": torch.cuda.memory_allocated() / MB,
                "max allocated": torch.cuda.max_memory_allocated() / MB,
                "reserved": torch.cuda.memory_reserved() / MB,
                "max reserved": torch.cuda.max_memory_reserved() / MB,
            }
        t = self.trace
        offload_optimizer, offload_param = offloaded(self.engine)
        host = (self.host_grads + optimizer_bytes(self.engine, host_only=True) if offload_optimizer else 0) + (
            parameter_bytes(self.engine.module, partitions_only=True) if offload_param else 0
        )
        return RankMemory(
            rank=rank,
            stage=stage,
            params=parameter_bytes(self.engine.module),
            grads=self.grads,
            optimizer=optimizer_bytes(self.engine),
            activations=self.activations.peak,
            peak=t.peak,
            held_at_start=t.held_at_start,
            held_at_end=t.held_at_end,
            inferred_frees=t.inferred_frees,
            unseen_frees=t.unseen_frees,
            cuda=cuda,
            host=host,
        )


def step_context(meter: StepMeter | None, step: int, measured_step: int) -> AbstractContextManager[None]:
    """What to wrap training step `step` in: `measure()` on `measured_step`, `warm_up()` on the
    step before it, nothing otherwise (or when `meter` is None)."""
    if meter is not None and step == measured_step:
        return meter.measure()
    if meter is not None and step == measured_step - 1:
        return meter.warm_up()
    return nullcontext()


def gather_report(mem: RankMemory) -> list[RankMemory]:
    """Every rank's measurement, on every rank (one all_gather_object)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, asdict(mem))
    return [RankMemory(**d) for d in out]
