"""Writing an imported checkpoint (Megatron-DeepSpeed's, Megatron-LM's) as ours: atomically, with its
weights at the source's T and its training state in universal form.

    OUT/latest                       the tag
    OUT/<tag>/megatron_ds.json       the run's config, iteration and counters, and where it came from
    OUT/<tag>/layer_XX-model_RR-...  our per-spec weight files (load at any P, T, DP and layout)
    OUT/<tag>.universal/             fp32 weights, optimizer states (when the source has them),
                                     learning-rate schedule, counters: what a resume restores

A source is a reader with the interface `universal.store.write` takes, plus `weight(tensor)`: the
model's weight as the source stores it (its dtype), as our full tensor.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_ds import files
from megatron_ds.config import Config
from megatron_ds.model import naming, sharding
from megatron_ds.training.checkpoint import reader
from megatron_ds.training.checkpoint.directory import LATEST, META
from megatron_ds.training.checkpoint.universal import store
from megatron_ds.training.checkpoint.universal.convert import SUFFIX
from megatron_ds.training.checkpoint.universal.names import ModelTensor, model_tensors


@dataclass
class UpstreamImport:
    """What converting an upstream trainer's checkpoint wrote, and how to continue from it."""

    output: str
    tag: str
    config: Config
    iteration: int
    states: list[str]
    """The optimizer states carried over (Adam: exp_avg, exp_avg_sq); [] when none are."""
    train_flags: list[str]
    """Our flags for its model, tokenizer and schedule (the upstream's spelling)."""
    notes: list[str] = field(default_factory=list)


def write(
    output: str,
    tag: str,
    meta: dict[str, Any],
    config: Config,
    open_source: Callable[[reader.Checkpoint], Any],
    check: Callable[[Any], None] = lambda source: None,
    show_progress: bool = True,
    weight_files: bool = True,
) -> list[str]:
    """Write the converted checkpoint into `output` (created; never overwritten); return the
    optimizer states carried over ([] when the source has none). `open_source` makes the reader
    for our checkpoint's metadata, once written; `check` validates it before any tensor is written.
    `weight_files` False (a mixture-of-experts model, which the per-spec readers refuse): the universal form
    alone holds the weights."""
    root = os.path.abspath(output)
    with files.atomic_directory(root, "output") as tmp:
        step_dir = os.path.join(tmp, tag)
        os.makedirs(step_dir)
        files.write_json(os.path.join(step_dir, META), meta)
        source = open_source(reader.Checkpoint(tmp, tag, meta, config))
        check(source)
        if weight_files:
            write_weights(source, step_dir, show_progress)
        universal = os.path.join(tmp, tag + SUFFIX)
        os.makedirs(universal)
        bar = files.progress(len(model_tensors(config.model)), "universal", show_progress)
        try:
            store.write(source, universal, bar)
        finally:
            bar.close()
        states = store.Universal(universal).states  # validated before the output gets its name
        with open(os.path.join(tmp, LATEST), "w") as f:
            f.write(tag)
    return states


def write_weights(source: Any, step_dir: str, show_progress: bool) -> None:
    """Our layer files at the source's T, in the source's weight dtype (as DeepSpeed writes them)."""
    model, t = source.model, source.tensor_parallel
    by_spec: dict[int, list[ModelTensor]] = defaultdict(list)
    for tensor in model_tensors(model):
        by_spec[tensor.spec_index].append(tensor)
    names = naming.gpt_spec_groups(model).names
    bar = files.progress(len(by_spec), "weights", show_progress)
    try:
        for index, tensors in sorted(by_spec.items()):
            states: list[dict[str, Any]] = [{} for _ in range(t)]
            for tensor in tensors:
                for state, piece in zip(states, sharding.split(tensor.rule, source.weight(tensor), t)):
                    state[tensor.key] = piece
            for rank, state in enumerate(states):
                state.update(dict.fromkeys(sharding.extra_state_keys(names[index], t)))
                torch.save(state, reader.layer_file(step_dir, index, rank))
            bar.update(1)
    finally:
        bar.close()
