"""Dropout random streams, one per spec, held in the one RNG tracker everything shares.

Why streams per spec: a layer's dropout masks are then a function of (seed, spec index, how
many micro-batches it has seen), not of which stage holds it or what ran before it on that
stage, so a pipelined run draws the same masks as a single-process run. Each spec has

  * a replicated stream (`Stream.replicated`): for activations every tensor rank holds in full
    (embedding output, residual branches); the same on every tensor rank and equal to T=1's;
  * a tensor-parallel stream (`Stream.tensor_parallel`): for activations split over tensor
    ranks (attention probabilities of this rank's heads); its seed includes the tensor rank,
    so different heads get independent masks, as in Megatron.

Why the tracker: the streams live in DeepSpeed's `get_cuda_rng_tracker()` (which is also
megatron-core's, see `megatron_ds.model.tensor_parallel`), and DeepSpeed's activation
checkpointing saves every tracker state before a checkpointed forward and restores it for the
recompute, so recomputation replays exactly the masks of the first forward. On CPU the tracker
swaps the CPU default generator's state; on GPU the device generator's.

Why in the layer's state dict (`checkpoint_streams`): a layer's stream states are saved in its
checkpoint file and restored with its weights, so a resumed run draws the masks the
uninterrupted run would have drawn, whatever the layout (the files are per spec).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ds.model.init import dropout_seed

STREAM_PREFIX = "megatron_ds/dropout/"
"""Names of our streams in the tracker (other entries, e.g. 'model-parallel-rng', are left alone)."""
STATE_DICT_KEY = "dropout_rng_states"
"""The state-dict entry of a layer's stream states: uint8 (num_streams, state bytes)."""


def tracker() -> Any:
    """The process's RNG tracker (DeepSpeed's; megatron-core is pointed at the same object)."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def _seeded_state(seed: int) -> torch.Tensor:
    """The accelerator generator's state after `manual_seed(seed)`, leaving the generator as it was."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
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


def dropout(x: torch.Tensor, p: float, training: bool, stream: Stream | None) -> torch.Tensor:
    """`F.dropout` with its mask drawn from `stream` (no draw at all when inactive)."""
    if not training or p == 0.0:
        return x
    assert stream is not None
    with stream.fork():
        return F.dropout(x, p, training=True)


def stream_states(streams: Sequence[Stream]) -> torch.Tensor:
    """The current states of `streams` (the seeded state for one not used yet), stacked."""
    live = tracker().get_states()
    return torch.stack([live[s.name] if s.name in live else _seeded_state(s.seed) for s in streams])


def restore_stream_states(streams: Sequence[Stream], states: torch.Tensor) -> None:
    """Inverse of `stream_states`: continue each stream from the given state."""
    assert states.shape[0] == len(streams), (tuple(states.shape), [s.name for s in streams])
    live = tracker().get_states()
    for s, state in zip(streams, states):
        live[s.name] = state.clone()
    tracker().set_states(live)


def checkpoint_streams(module: nn.Module, *streams: Stream) -> None:
    """Save `streams`' states in `module`'s state dict (`STATE_DICT_KEY`) and restore them on load.

    A state dict without the entry (an older checkpoint) leaves the streams as they are.
    """

    def save(mod: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        state_dict[prefix + STATE_DICT_KEY] = stream_states(streams)

    def load(mod: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        states = state_dict.pop(prefix + STATE_DICT_KEY, None)  # popped: not a parameter or buffer
        if states is not None:
            restore_stream_states(streams, states)

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)
