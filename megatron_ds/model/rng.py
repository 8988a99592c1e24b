"""Dropout random streams, one per spec, reseeded for every micro-batch from its global index.

Why streams per spec: a layer's dropout masks are a function of (seed, spec index, global
micro-batch index) alone, not of which stage holds the layer, what ran before it on that stage,
how many data-parallel replicas share the batch, or how the run was interrupted. Each spec has

  * a replicated stream (`Stream.replicated`): for activations every tensor rank holds in full
    (embedding output, residual branches); the same on every tensor rank and equal to T=1's;
  * a tensor-parallel stream (`Stream.tensor_parallel`): for activations split over tensor
    ranks (attention probabilities of this rank's heads); its seed includes the tensor rank,
    so different heads get independent masks, as in Megatron. Another T therefore draws other
    attention-dropout masks (by construction, as Megatron); hidden dropout is T-independent.

Why reseeded per micro-batch (`install_micro_batch_seeding`): before each training forward on a
stage, every stream of the stage's specs restarts from a seed mixed from the stream's seed and
the global index of the micro-batch's first sample, g = samples consumed before the step +
(j x DP + d) x micro batch (micro-batch j of data-parallel rank d, Megatron's sample order). So
DP=2 draws the masks DP=1 draws for the same samples, and a resumed run, under any layout, P, DP
or ZeRO stage, draws exactly the masks the uninterrupted run would have drawn: the RNG state that
matters is the seed and the consumed samples.

Why the tracker: the streams live in DeepSpeed's `get_cuda_rng_tracker()` (which is also
megatron-core's, see `megatron_ds.model.tensor_parallel_layers`), and DeepSpeed's activation
checkpointing saves every tracker state before a checkpointed forward and restores it for the
recompute, so recomputation replays exactly the masks of the first forward. On CPU the tracker
swaps the CPU default generator's state; on GPU the device generator's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ds.model.init import dropout_seed
from megatron_ds.model.tensor_parallel_rank import NO_SHARD, SequenceShard

STREAM_PREFIX = "megatron_ds/dropout/"
"""Names of our streams in the tracker (other entries, e.g. 'model-parallel-rng', are left alone)."""
STREAMS_ATTRIBUTE = "dropout_streams"
"""The module attribute `register_streams` sets: the layer's streams, found by `module_streams`."""
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def tracker() -> Any:
    """The process's RNG tracker (DeepSpeed's; megatron-core is pointed at the same object)."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def _seeded_state(seed: int) -> torch.Tensor:
    """The accelerator generator's state after `manual_seed(seed)`, leaving the generator as it was."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() == "cpu":
        # The same state from a private generator: `torch.manual_seed` (what the CPU accelerator's
        # `manual_seed` is) also queues a lazy seed for CUDA, MTIA and XPU, each with a formatted
        # stack trace, ~0.5 ms per call, once per stream per micro-batch (25 ms a micro-batch for a
        # 24-layer stage, which the stage timers counted as forward compute).
        return torch.Generator(device="cpu").manual_seed(seed).get_state()
    saved = acc.get_rng_state()
    acc.manual_seed(seed)
    state = acc.get_rng_state()
    acc.set_rng_state(saved)
    return state


def set_stream(name: str, seed: int) -> None:
    """(Re)start tracker stream `name` from `seed` (replaces an existing one, unlike `tracker().add`)."""
    states = tracker().get_states()
    states[name] = _seeded_state(seed)
    tracker().set_states(states)


def reset_streams() -> None:
    """Forget every dropout stream: the next use of each starts again from its seed.

    Called when a model is built, so a second model in the same process starts fresh.
    """
    states = {k: v for k, v in tracker().get_states().items() if not k.startswith(STREAM_PREFIX)}
    tracker().set_states(states)


@dataclass(frozen=True)
class Stream:
    """A named dropout stream; created from its seed on first use."""

    name: str
    seed: int

    @classmethod
    def replicated(cls, init_seed: int) -> Stream:
        return cls(f"{STREAM_PREFIX}{init_seed}", dropout_seed(init_seed))

    @classmethod
    def tensor_parallel(cls, init_seed: int, tensor_parallel_rank: int) -> Stream:
        return cls(
            f"{STREAM_PREFIX}{init_seed}/tp{tensor_parallel_rank}", dropout_seed(init_seed, tensor_parallel_rank)
        )

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Draw from this stream inside the block (the default generator is restored after)."""
        if self.name not in tracker().get_states():
            set_stream(self.name, self.seed)
        with tracker().fork(self.name):
            yield


def dropout(
    x: torch.Tensor, p: float, training: bool, stream: Stream | None, shard: SequenceShard = NO_SHARD
) -> torch.Tensor:
    """`F.dropout` with its mask drawn from `stream` (no draw at all when inactive).

    `x` may be this rank's part of a tensor split along the sequence (`shard`): the mask is then the
    part of the one the whole (b, s, h) tensor draws, so it does not depend on the split. On CPU that
    is bit for bit the unsplit `F.dropout`'s mask (whose kernel is `bernoulli_(1 - p)` on an empty
    tensor of the input's shape, then a division by 1 - p); each rank draws the whole mask, a
    short-lived (b, s, h) tensor, and keeps its part.
    """
    if not training or p == 0.0:
        return x
    assert stream is not None
    if shard.size == 1:
        with stream.fork():
            return F.dropout(x, p, training=True)
    whole = list(x.shape)
    whole[shard.dim] *= shard.size
    if shard.dim == 0:  # sequence-first (s, b, h): draw in the batch-first order of the unsplit tensor
        whole[0], whole[1] = whole[1], whole[0]
    with stream.fork():
        noise = torch.empty(whole, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    if shard.dim == 0:
        noise = noise.transpose(0, 1)
    part = x.shape[shard.dim]
    mine = noise.narrow(shard.dim, shard.rank * part, part).clone()  # its own storage (a view would keep the whole)
    del noise
    return x * mine.div_(1 - p)


def register_streams(module: nn.Module, *streams: Stream) -> None:
    """Declare `module`'s dropout streams (reseeded per micro-batch by `install_micro_batch_seeding`)."""
    setattr(module, STREAMS_ATTRIBUTE, tuple(streams))


def module_streams(module: nn.Module) -> list[Stream]:
    """Every stream registered by `module` and its submodules, each once, in module order."""
    seen: dict[str, Stream] = {}
    for sub in module.modules():
        for s in getattr(sub, STREAMS_ATTRIBUTE, ()):
            seen.setdefault(s.name, s)
    return list(seen.values())


def micro_batch_seed(stream_seed: int, index: int) -> int:
    """A seed in [0, 2**63) for stream `stream_seed` at global micro-batch `index` (splitmix64 mixing:
    the CPU generator keeps only the low 32 bits of a seed, so every bit must depend on both inputs)."""
    x = (stream_seed * _GOLDEN + index) & _MASK64
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def seed_streams(streams: Sequence[Stream], index: int) -> None:
    """Restart every stream in `streams` from its seed for global micro-batch `index`."""
    states = tracker().get_states()
    for s in streams:
        states[s.name] = _seeded_state(micro_batch_seed(s.seed, index))
    tracker().set_states(states)


def micro_batch_first_sample(
    samples_before_step: int, local: int, micro_batch_size: int, data_parallel: int, data_parallel_rank: int
) -> int:
    """Global index of the first sample of micro-batch `local` of data-parallel rank
    `data_parallel_rank` in a step that starts after `samples_before_step` samples (Megatron's
    order: micro-batch j of rank d holds samples (j x DP + d) x mbs + [0, mbs) of the step)."""
    return samples_before_step + (local * data_parallel + data_parallel_rank) * micro_batch_size


def install_micro_batch_seeding(engine: Any, forward_micro_batches: Callable[[int], Sequence[int]]) -> None:
    """Reseed the stage's dropout streams before each training forward of DeepSpeed's pipeline
    engine from `micro_batch_first_sample(engine.global_samples, j, ...)`, j the micro-batch of the
    step's k-th forward on this stage: `forward_micro_batches(m)[k]` for a step of m micro-batches,
    read off the pipeline schedule (`estimate.pipeline_schedules.forward_micro_batches`; m is
    `engine.micro_batches`, which a batch-size ramp-up changes; `global_samples` counts the samples
    of the steps taken, restored on load). A stage without dropout streams gets no hook.
    """
    module = engine.module
    streams = module_streams(module)
    if not streams:
        return
    grid = engine.grid
    data_parallel, data_parallel_rank = grid.data_parallel_size, grid.get_data_parallel_rank()
    micro_batch_size = engine.train_micro_batch_size_per_gpu()
    clock = {"samples": -1, "local": 0}
    orders: dict[int, Sequence[int]] = {}

    def before_forward(mod: nn.Module, args: Any) -> None:
        if not mod.training:
            return  # evaluation draws no masks
        samples = int(engine.global_samples)
        if samples != clock["samples"]:  # a new step
            clock.update(samples=samples, local=0)
        m = int(engine.micro_batches)
        order = orders.get(m) or orders.setdefault(m, forward_micro_batches(m))
        local = order[clock["local"]]
        first = micro_batch_first_sample(samples, local, micro_batch_size, data_parallel, data_parallel_rank)
        clock["local"] += 1
        seed_streams(streams, first)

    module.register_forward_pre_hook(before_forward)
