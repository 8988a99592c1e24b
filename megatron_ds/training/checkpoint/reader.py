"""Read one of our checkpoints as full (T=1) tensors, one spec file set and one tensor at a time.

A checkpoint is `DIR/latest` -> `DIR/global_stepN/` holding `megatron_ds.json` (config, train
state) and DeepSpeed's `layer_XX-model_YY-model_states.pt` per spec index XX and tensor rank YY
(see `megatron_ds.training.checkpoint.save_load`). The layer files are read with `torch.load(...,
weights_only=True, mmap=True)`: no code from the file runs, and a tensor's bytes are read only
when it is gathered. Nothing here needs torch.distributed, DeepSpeed or a GPU.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_ds import files
from megatron_ds.data.tokenizer import Tokenizer, build_tokenizer
from megatron_ds.model import naming, sharding
from megatron_ds.training.checkpoint.directory import (
    META,
    TOKENIZER_DIR,
    UNIVERSAL_FORMAT,
    CheckpointError,
    recorded_vocab_size,
)
from megatron_ds.training.checkpoint.opening import Checkpoint as Checkpoint
from megatron_ds.training.checkpoint.opening import open_checkpoint as open_checkpoint
from megatron_ds.training.checkpoint.opening import read_config as read_config


@dataclass(frozen=True)
class SpecTensor:
    """One full tensor of one spec."""

    index: int
    """Spec index (the XX of the layer files)."""
    spec: str
    """Spec name (`megatron_ds.model.naming`)."""
    layer: int | None
    """Transformer layer number for TransformerLayer specs, else None."""
    key: str
    rule: sharding.TensorRule
    tensor: torch.Tensor


def layer_file(directory: str, index: int, tensor_rank: int) -> str:
    """DeepSpeed's name for spec `index`'s file on tensor rank `tensor_rank`."""
    return os.path.join(directory, f"layer_{index:02d}-model_{tensor_rank:02d}-model_states.pt")


def load_state(path: str) -> dict[str, Any]:
    """One layer file's state, tensors only (`weights_only`, memory-mapped); CheckpointError naming it if it is
    missing, damaged or holds anything but tensors."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(files.load_failure(path, err, "the checkpoint is damaged or truncated")) from None


def refuse_universal(ckpt: Checkpoint) -> None:
    """A universal checkpoint holds no weight files: the one-line CheckpointError of the weight readers."""
    if ckpt.meta.get("format") == UNIVERSAL_FORMAT:
        raise CheckpointError(
            f"{ckpt.directory}: a universal checkpoint (training state, no per-spec weight files); give the "
            f"checkpoint it was converted from, or resume it with pretrain_gpt.py --load and --save a regular one"
        )


def iter_tensors(ckpt: Checkpoint) -> Iterator[SpecTensor]:
    """Every tensor of the model as its full T=1 tensor, in spec order (tied head: no entry)."""
    refuse_universal(ckpt)
    model = ckpt.config.model
    groups = naming.gpt_spec_groups(model)
    for index, spec in enumerate(groups.names):
        rules = sharding.spec_tensors(model, spec)
        if not rules:
            continue
        states = [load_state(layer_file(ckpt.directory, index, r)) for r in range(ckpt.tensor_parallel)]
        for key, rule in rules.items():
            yield SpecTensor(index, spec, groups.layer_of(index), key, rule, _gathered(ckpt, index, key, rule, states))
        del states


def read_spec_tensor(ckpt: Checkpoint, index: int, key: str, rule: sharding.TensorRule) -> torch.Tensor:
    """One full T=1 tensor (`key` of spec `index`), read from its layer files alone."""
    states = [load_state(layer_file(ckpt.directory, index, r)) for r in range(ckpt.tensor_parallel)]
    return _gathered(ckpt, index, key, rule, states)


def _gathered(
    ckpt: Checkpoint, index: int, key: str, rule: sharding.TensorRule, states: list[dict[str, Any]]
) -> torch.Tensor:
    shards = [_tensor(s, key, layer_file(ckpt.directory, index, r)) for r, s in enumerate(states)]
    if rule.split == sharding.REPLICATED and sharding.replicas_differ(shards):
        raise CheckpointError(
            f"{layer_file(ckpt.directory, index, 0)}: {key} differs between tensor-parallel ranks; "
            f"the checkpoint is damaged"
        )
    full = sharding.gather(rule, shards)
    if tuple(full.shape) != rule.shape:
        raise CheckpointError(
            f"{layer_file(ckpt.directory, index, 0)}: {key} has shape {tuple(full.shape)}, the config in "
            f"{META} implies {rule.shape}; the checkpoint is damaged"
        )
    return full


def _tensor(state: dict[str, Any], key: str, path: str) -> torch.Tensor:
    value = state.get(key)
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{path}: no tensor {key!r}; the checkpoint is damaged or of another model")
    return value


def checkpoint_tokenizer(ckpt: Checkpoint, overrides: dict[str, str | None] | None = None) -> Tokenizer | None:
    """Our tokenizer of the checkpoint (None for --mock-data runs without one).

    `overrides` (tokenizer_type, tokenizer_model, vocab_file, merge_file) replace recorded values;
    a recorded file that no longer exists is looked for in `<root>/tokenizer/` (where imports put it).
    """
    data = ckpt.config.data
    fields = {k: getattr(data, k) for k in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")}
    fields.update({k: v for k, v in (overrides or {}).items() if v is not None})
    if not fields["tokenizer_type"] or fields["tokenizer_type"] == "NullTokenizer":
        return None
    for key in ("tokenizer_model", "vocab_file", "merge_file"):
        path = fields[key]
        if path and not os.path.isfile(path):
            beside = os.path.join(ckpt.root, TOKENIZER_DIR, os.path.basename(path))
            fields[key] = beside if os.path.isfile(beside) else path
    return build_tokenizer(fields.pop("tokenizer_type"), **fields)


def unpadded_vocab_size(ckpt: Checkpoint, tokenizer: Tokenizer | None, override: int | None = None) -> int:
    """Rows of the vocabulary without `--make-vocab-size-divisible-by` padding.

    In order: `override` (a `--vocab-size` flag), the size an import recorded, the tokenizer's
    size, else the padded size (nothing says how much is padding).
    """
    padded = ckpt.config.model.vocab_size
    recorded = recorded_vocab_size(ckpt.meta)
    size = (
        override
        if override is not None
        else recorded or (tokenizer.vocab_size if tokenizer is not None else None) or padded
    )
    if not 1 <= size <= padded:
        raise CheckpointError(
            f"--vocab-size {size}: the checkpoint {ckpt.directory} has {padded} vocabulary rows; give 1 to {padded}"
        )
    if override is not None and recorded and override < recorded:  # those rows are tokens, not padding
        raise CheckpointError(
            f"--vocab-size {override}: the checkpoint {ckpt.directory} records {recorded} tokens, so rows {override} "
            f"to {recorded - 1} are tokens that would be cut; give {recorded}, or drop the flag"
        )
    return size
