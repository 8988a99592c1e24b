"""The layout-free (universal) checkpoint on disk: writing it tensor by tensor, validating it, reading it.

    <universal dir>/megatron_ds.json            written last: config, train state, engine counters,
                                                learning-rate schedule, optimizer, RNG, and a table
                                                of every tensor (shape, group, step, file sizes and
                                                SHA-256 digests)
    <universal dir>/tensors/<name>/fp32.pt       the full fp32 master weight (T=1 shape, padded
                                                vocabulary rows included)
    <universal dir>/tensors/<name>/<state>.pt    each optimizer state of it (Adam: exp_avg, exp_avg_sq)

Each `.pt` file is `torch.save` of one plain tensor and is read with `weights_only=True`.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from megatron_ds import files
from megatron_ds.config import Config
from megatron_ds.errors import UserError
from megatron_ds.training.checkpoint import reader
from megatron_ds.training.checkpoint.directory import META, UNIVERSAL_FORMAT, CheckpointError
from megatron_ds.training.checkpoint.directory import sha256 as _sha256
from megatron_ds.training.checkpoint.universal import names
from megatron_ds.training.checkpoint.universal.deepspeed_source import FP32, DeepSpeedSource

FORMAT = UNIVERSAL_FORMAT
VERSION = 1
TENSORS_DIR = "tensors"
DROPOUT_RNG = (
    "dropout masks are drawn from per-spec streams reseeded for every micro-batch from (seed, spec, "
    "global index of its first sample), so the seed and consumed_train_samples reproduce them"
)


def is_universal(meta: dict[str, Any]) -> bool:
    return meta.get("format") == FORMAT


def tensor_file(name: str, state: str) -> str:
    return os.path.join(TENSORS_DIR, name, f"{state}.pt")


@dataclass
class Written:
    """What `write` put on disk."""

    tensors: int
    files: int
    bytes: int


def write(source: DeepSpeedSource, directory: str, progress: Any) -> Written:
    """Write `source`'s whole training state into `directory` (exists, empty); metadata last.

    `source` is a `DeepSpeedSource` or a reader of the same interface (`ckpt`, `model`,
    `state_keys`, `step`, `read`, `engine_state`, `loss_scaler`, `record`), e.g. the Megatron-DeepSpeed
    import's (`megatron_ds.interop.megatron_deepspeed_source`)."""
    ckpt = source.ckpt
    keys = source.state_keys()
    table: dict[str, Any] = {}
    written = Written(0, 0, 0)
    for tensor in names.model_tensors(source.model):
        entry: dict[str, Any] = {"shape": list(tensor.rule.shape), "group": tensor.group, "files": {}}
        entry["step"] = source.step(tensor) if keys else None
        for state in (FP32, *keys):
            entry["files"][state] = _save(source.read(tensor, state), directory, tensor_file(tensor.name, state))
            written.files += 1
            written.bytes += entry["files"][state]["bytes"]
        table[tensor.name] = entry
        written.tensors += 1
        progress.update(1)
    engine = source.engine_state()
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "config": ckpt.meta["config"],
        "train_state": ckpt.meta["train_state"],
        "source": source.record(),
        "engine": {k: engine[k] for k in ("global_steps", "global_samples", "skipped_steps")},
        "lr_scheduler": engine["lr_scheduler"],
        "optimizer": {
            "name": source.ckpt.config.optimizer.optimizer,
            "states": keys,
            "loss_scaler": source.loss_scaler(),
        },
        "rng": {"seed": ckpt.config.training.seed, "dropout": DROPOUT_RNG},
        "vocabulary": {"rows": source.model.vocab_size, "unpadded": _unpadded_vocabulary(source)},
        "placeholders": "optimizer-group placeholders are not stored: zero, with zero state, on every stage that has one",
        "tensors": table,
    }
    try:
        json.dumps(meta)
    except TypeError:  # a scheduler whose state is not JSON: kept as a tensor-free torch file
        torch.save(meta.pop("lr_scheduler"), os.path.join(directory, "lr_scheduler.pt"))
        meta["lr_scheduler"] = "lr_scheduler.pt"
    files.write_json(os.path.join(directory, META), meta)
    return written


def _unpadded_vocabulary(source: DeepSpeedSource) -> int | None:
    """Rows that are tokens (the rest is `--make-vocab-size-divisible-by` padding, stored and trained
    as the model has it); None when neither an import nor a tokenizer says."""
    try:
        tokenizer = reader.checkpoint_tokenizer(source.ckpt)
    except (UserError, OSError, ValueError):
        tokenizer = None
    return reader.recorded_vocab_size(source.ckpt.meta) or (tokenizer.vocab_size if tokenizer else None)


def _save(value: torch.Tensor, directory: str, relative: str) -> dict[str, Any]:
    path = os.path.join(directory, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(value.contiguous(), path)  # `read` gives a fresh tensor: its storage is exactly this tensor
    return {"bytes": os.path.getsize(path), "sha256": _sha256(path)}


class Universal:
    """A validated universal directory; `read` checks each file's digest and shape."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        self.meta = _read_meta(self.directory)
        self.config = _config(self.meta, self.directory)
        self._check_files()
        self._digested: set[str] = set()
        """Files whose SHA-256 `read` has checked already (a resume checks every file first, then reads it)."""

    @property
    def tensors(self) -> dict[str, Any]:
        return self.meta["tensors"]

    @property
    def states(self) -> list[str]:
        """Optimizer states stored per tensor ([] when the source had taken no step)."""
        return list(self.meta["optimizer"]["states"])

    def _check_files(self) -> None:
        expected = {t.name: t for t in names.model_tensors(self.config.model)}
        table = self.tensors
        missing = sorted(set(expected) - set(table))
        extra = sorted(set(table) - set(expected))
        if missing or extra:
            raise self._damaged(f"its table lacks {missing[:3]} / has unknown {extra[:3]} tensors for its config")
        for name, t in expected.items():
            entry = table[name]
            if tuple(entry.get("shape", ())) != t.rule.shape:
                raise self._damaged(f"{name} has shape {entry.get('shape')}, its config implies {list(t.rule.shape)}")
            for state in (FP32, *self.states):
                record = entry.get("files", {}).get(state)
                path = os.path.join(self.directory, tensor_file(name, state))
                if record is None or not os.path.isfile(path):
                    raise self._damaged(f"{tensor_file(name, state)} is missing")
                if os.path.getsize(path) != record["bytes"]:
                    raise self._damaged(
                        f"{tensor_file(name, state)} has {os.path.getsize(path)} bytes, {record['bytes']} were written"
                    )

    def _damaged(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"{self.directory}: {what}; this converted checkpoint is damaged or partial: delete it and convert "
            f"the source again"
        )

    def read(self, name: str, state: str) -> torch.Tensor:
        """One full tensor, after checking its file's SHA-256 (once per file) and its shape against the table."""
        entry = self.tensors[name]
        relative = tensor_file(name, state)
        path = os.path.join(self.directory, relative)
        if relative not in self._digested:
            if _sha256(path) != entry["files"][state]["sha256"]:
                raise self._damaged(f"{relative} does not match its recorded SHA-256")
            self._digested.add(relative)
        try:
            value = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError) as err:
            raise self._damaged(
                f"{relative} is unreadable ({str(err).splitlines()[0] if str(err) else err!r})"
            ) from None
        if not isinstance(value, torch.Tensor) or list(value.shape) != entry["shape"]:
            raise self._damaged(f"{relative} does not hold a tensor of shape {entry['shape']}")
        return value

    def lr_scheduler_state(self) -> Any:
        state = self.meta.get("lr_scheduler")
        if state == "lr_scheduler.pt":
            return torch.load(os.path.join(self.directory, state), weights_only=True)
        return state

    def group_step(self, group: str) -> int | None:
        """The optimizer step count of `group`'s tensors (all equal: one optimizer step for all)."""
        steps = {e["step"] for e in self.tensors.values() if e["group"] == group and e.get("step") is not None}
        if len(steps) > 1:
            raise self._damaged(f"the {group} group's tensors record different step counts {sorted(steps)}")
        return steps.pop() if steps else None


def _read_meta(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, META)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{directory}: no {META}; this converted checkpoint is partial: delete it and convert the source again"
        )
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable ({err}); delete {directory} and convert the source again") from None
    if not is_universal(meta) or meta.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: not a version-{VERSION} universal checkpoint (format {meta.get('format')!r}, version "
            f"{meta.get('version')!r}); convert the source with this version of megatron_ds"
        )
    for key in ("config", "train_state", "engine", "optimizer", "tensors"):
        if not isinstance(meta.get(key), dict):
            raise CheckpointError(f"{path}: no {key!r} section; delete {directory} and convert the source again")
    return meta


def _config(meta: dict[str, Any], directory: str) -> Config:
    try:
        return Config.from_dict(meta["config"])
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{directory}/{META}: its config is invalid ({err}); it is damaged") from None
