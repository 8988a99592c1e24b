"""Measured per-rank memory of one `train_batch`: model states, saved activations and the true peak.

`StepMeter.measure()` wraps the one reported `train_batch` (`warm_up()` the step before it; no
other step is profiled) and measures on this rank's device, with no estimate anywhere:

- params: the bytes of every parameter storage of this rank's module.
- grads: the bytes of every gradient tensor alive just before the optimizer step (parameters'
  `.grad` and the optimizer wrapper's gradient buffers, such as ZeRO's flat fp32 partition
  gradient), read by a step pre-hook.
- optimizer: every other tensor reachable from the optimizer objects (Adam moments and step
  counters, fp32 master copies, ZeRO partitions), by storage, parameters excluded.
- activations: the peak of tensors saved for backward across the whole step (all micro-batches in
  flight under DeepSpeed's 1F1B schedule), by storage, through
  `torch.autograd.graph.saved_tensors_hooks`, parameters excluded.
- peak (the total): the most the rank holds at any moment of the step. On CPU: the tensor storages
  alive when the step starts (a scan of the garbage collector's objects) plus the running sum of
  every allocation and free of the CPU allocator during the step, from torch.profiler's memory
  events (`CpuAllocationTrace` says how its blind spots are closed). On CUDA: torch.cuda's max
  allocated over the step, and allocated / max allocated / reserved are printed too.
- other: peak - (params + grads + optimizer + activations): pipe buffers (received activations,
  outputs kept until their backward, the last stage's fp32 logits), short-lived buffers (loss
  gradients, a weight gradient before accumulation, the gradient all-reduce's flat copy, the
  optimizer's temporaries). The components peak at different moments (no gradient exists while
  the first micro-batches' activations pile up), so `other` is a remainder and can be negative.
"""
from __future__ import annotations

import gc
import os
import sys
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any, ContextManager, Iterator, Optional

import torch

MB = 1024.0 * 1024.0


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())


def _param_keys(module: torch.nn.Module) -> set[tuple[int, int]]:
    return {_storage_key(p) for p in module.parameters()}


def _tensors(obj: Any, path: str, depth: int, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor reachable from an optimizer object, its state and its attributes."""
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


def _optimizer_roots(engine: Any) -> list[Any]:
    return [r for r in (engine.optimizer, getattr(engine, "basic_optimizer", None)) if r is not None]


def gradient_bytes(engine: Any) -> int:
    """Bytes of gradient tensors alive now: module `.grad`s and gradient buffers the optimizer holds."""
    module_keys = _param_keys(engine.module)
    seen: dict[tuple[int, int], int] = {}
    for p in engine.module.parameters():
        if p.grad is not None:
            seen[_storage_key(p.grad)] = p.grad.untyped_storage().nbytes()
    for root in _optimizer_roots(engine):
        for path, t in _tensors(root, "opt", 5, set()):
            key = _storage_key(t)
            if "grad" in path.lower() and key not in module_keys:
                seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


def optimizer_bytes(engine: Any) -> int:
    """Bytes of optimizer-held tensors that are neither parameters nor gradients."""
    module_keys = _param_keys(engine.module)
    seen: dict[tuple[int, int], int] = {}
    for root in _optimizer_roots(engine):
        for path, t in _tensors(root, "opt", 5, set()):
            key = _storage_key(t)
            if key not in module_keys and "grad" not in path.lower() and t.numel() > 0:
                seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameter storages (a flat buffer shared by views counted once)."""
    return sum({_storage_key(p): p.untyped_storage().nbytes() for p in module.parameters()}.values())


def live_storages(engine: Any, device: torch.device) -> dict[int, int]:
    """Address -> bytes of every distinct tensor storage on `device` alive now.

    Tensors with a Python object are found through `gc.get_objects()`; gradients and optimizer
    tensors that may exist only on the C++ side are added from the module and the optimizer.
    """
    seen: dict[int, int] = {}

    def add(t: Optional[torch.Tensor]) -> None:
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


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null: only around the profiler's start and stop, whose C++
    side prints a `profiler_start` / `profiler_stop` trace line on every rank."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


MEASURED_STEP = "megatron_ds.memory.measured_step"
"""Name of the profiler range around the measured step."""


class CpuAllocationTrace:
    """Peak of the running sum of CPU allocations minus frees inside `window()`.

    torch.profiler (profile_memory=True, record_shapes=True) records one event per block the CPU
    allocator hands out or takes back, and which blocks every operator reads. Two blind spots
    are handled:

    * A block allocated before the profiler started and freed while it runs is not reported
      (the allocator only knows the sizes of blocks it handed out while profiling). That is why
      the trace starts one step before the measured window: the pipe-buffer slots DeepSpeed leaves
      filled after a step (the last stage's fp32 logits, the first stage's token ids) are replaced
      in the next step, so after one traced step every block the window frees is known.
    * Only the threads the profiler runs on report frees. A tensor whose last reference a gloo
      worker thread drops (the flat gradient copy of DeepSpeed's all-reduce, a sent gradient)
      is freed unseen. A block with no free event that is not alive when the window ends (its
      address is not a live tensor's storage, or was handed out again) is taken as freed when
      the last operator that read it ended; `inferred_frees` counts them.

    What is alive at the window's start and end combines both sources: the blocks the trace saw
    allocated and not yet freed, plus the scanned storages (`live_storages`) at other addresses,
    which were allocated before the trace (a scan cannot see a tensor only C++ holds, such as
    the flat gradient copy a gloo work object still references). `unseen_frees` is what those
    older storages lost during the window: the one blind spot left, 0 when the warm-up worked.
    """

    def __init__(self) -> None:
        self.held_at_start = self.peak = self.held_at_end = 0
        self.inferred_frees = self.unseen_frees = 0
        self._prof: Any = None

    @property
    def started(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True)
        with _stderr_silenced():
            primer = torch.empty(1)
            self._prof.__enter__()
            # The CPU allocator warns (once, then every 1000th time) when a block allocated before
            # profiling is freed; that is expected here (see the class docstring), so spend the
            # first warning on a 4-byte block freed while stderr is silenced.
            del primer

    @contextmanager
    def window(self) -> Iterator[None]:
        with torch.profiler.record_function(MEASURED_STEP):
            yield

    def stop(self, at_start: Optional[dict[int, int]] = None, at_end: Optional[dict[int, int]] = None) -> None:
        """End the trace; given the storages (address -> bytes) alive at the window's start and
        end, compute what was held at the start, at the peak and at the end."""
        prof, self._prof = self._prof, None
        with _stderr_silenced():
            prof.__exit__(None, None, None)
        if at_start is None or at_end is None:
            return
        blocks, window, inferred = _traced_blocks(prof.profiler.kineto_results, "cpu", set(at_end))
        self.inferred_frees = inferred
        events = sorted([(b[0], b[1]) for b in blocks] + [(b[3], -b[1]) for b in blocks if b[3] is not None])
        traced_then = [{b[2] for b in blocks if b[0] < t and (b[3] is None or b[3] >= t)} for t in window]
        older = [sum(n for ptr, n in scan.items() if ptr not in traced) for scan, traced in zip((at_start, at_end),
                                                                                                 traced_then)]
        current, start, peak = 0, None, 0  # bytes of traced blocks alive
        for t, size in events:
            if t > window[1]:
                break
            if start is None and t >= window[0]:
                start = peak = current
            current += size
            peak = max(peak, current) if start is not None else peak
        start = current if start is None else start
        self.held_at_start = older[0] + start
        self.peak = older[0] + max(peak, start)
        self.held_at_end = older[1] + current
        self.unseen_frees = older[0] - older[1]


def _input_ptrs(inputs: Any) -> Iterator[int]:
    for x in inputs:
        if isinstance(x, list):
            yield from _input_ptrs(x)
        elif getattr(x, "storage_data_ptr", None):
            yield x.storage_data_ptr


def _traced_blocks(results: Any, device_type: str, live_ptrs: set[int]) -> tuple[list[list], tuple[int, int], int]:
    """([allocated at, bytes, address, freed at or None] for every block allocated in the trace,
    the `MEASURED_STEP` window (start, end), the number of inferred frees); see CpuAllocationTrace.

    Blocks are paired by address in time order (the profiler's own allocation ids merge two
    blocks at one address when the first one's free went unseen).
    """
    from torch._C._profiler import _EventType

    ALLOC, READ = 0, 1
    events, window = [], None  # (time, kind, address, bytes or read end)
    stack = list(results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == device_type:
            events.append((node.start_time_ns, ALLOC, node.extra_fields.ptr, node.extra_fields.alloc_size))
        elif node.tag == _EventType.TorchOp:
            if node.name == MEASURED_STEP:
                window = (node.start_time_ns, node.end_time_ns)
            events.extend((node.start_time_ns, READ, ptr, node.end_time_ns) for ptr in _input_ptrs(node.extra_fields.inputs))
    assert window is not None, "the measured step's profiler range is missing"
    blocks, open_at, last_read = [], {}, {}  # open_at: address -> index of the block there not yet freed
    inferred = 0

    def close_unseen(i: int) -> None:
        nonlocal inferred
        blocks[i][3], inferred = max(blocks[i][0], last_read.get(i, 0)), inferred + 1

    for t, kind, ptr, value in sorted(events, key=lambda e: e[:2]):
        i = open_at.get(ptr)
        if kind == READ:
            if i is not None:
                last_read[i] = max(last_read.get(i, 0), value)
        elif value > 0:
            if i is not None:  # handed out again: the block there was freed unseen
                close_unseen(i)
            open_at[ptr] = len(blocks)
            blocks.append([t, value, ptr, None])
        elif i is not None:  # frees of blocks allocated before the trace are not reported
            blocks[i][3] = t
            del open_at[ptr]
    for ptr, i in open_at.items():
        if ptr not in live_ptrs:
            close_unseen(i)
    return blocks, window, inferred


class CudaAllocationTrace:
    """The CUDA caching allocator's own counters: allocated at the window's start and end, and its
    max allocated inside the window."""

    def __init__(self) -> None:
        self.held_at_start = self.peak = self.held_at_end = 0
        self.inferred_frees = self.unseen_frees = 0
        self.started = False

    def start(self) -> None:
        self.started = True

    @contextmanager
    def window(self) -> Iterator[None]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.held_at_start = torch.cuda.memory_allocated()
        yield
        torch.cuda.synchronize()
        self.peak, self.held_at_end = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()

    def stop(self, at_start: Optional[dict[int, int]] = None, at_end: Optional[dict[int, int]] = None) -> None:
        self.started = False


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
    """Blocks freed on a thread the trace does not see (see CpuAllocationTrace)."""
    unseen_frees: int = 0
    """Bytes allocated before the trace and freed unseen during the step: the measurement's error
    bound (the peak may be too high by at most this much); 0 when the warm-up worked."""
    cuda: Optional[dict[str, float]] = None

    @property
    def total(self) -> int:
        return self.peak

    @property
    def other(self) -> int:
        """Pipe buffers, transients and anything else at the peak (a remainder, see the module docstring)."""
        return self.peak - (self.params + self.grads + self.optimizer + self.activations)

    def format(self, iteration: int) -> str:
        line = (f"[Rank {self.rank} | stage {self.stage}] (after {iteration} iterations) memory (MB) | "
                f"params: {self.params / MB:.2f} | grads: {self.grads / MB:.2f} | "
                f"optimizer: {self.optimizer / MB:.2f} | activations (peak saved): {self.activations / MB:.2f} | "
                f"other (buffers, transients): {self.other / MB:.2f} | total (measured peak): {self.peak / MB:.2f}")
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
        self.grads = 0
        self.activations = ActivationPeak(engine.module)
        self.trace = CudaAllocationTrace() if self.device.type == "cuda" else CpuAllocationTrace()
        self.measured = False

    def _on_step(self, *_: Any) -> None:
        self.grads = max(self.grads, gradient_bytes(self.engine))

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
            cuda = {"allocated": torch.cuda.memory_allocated() / MB,
                    "max allocated": torch.cuda.max_memory_allocated() / MB,
                    "reserved": torch.cuda.memory_reserved() / MB,
                    "max reserved": torch.cuda.max_memory_reserved() / MB}
        t = self.trace
        return RankMemory(rank=rank, stage=stage, params=parameter_bytes(self.engine.module), grads=self.grads,
                          optimizer=optimizer_bytes(self.engine), activations=self.activations.peak, peak=t.peak,
                          held_at_start=t.held_at_start, held_at_end=t.held_at_end,
                          inferred_frees=t.inferred_frees, unseen_frees=t.unseen_frees, cuda=cuda)


def step_context(meter: Optional[StepMeter], step: int, measured_step: int) -> ContextManager[None]:
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
