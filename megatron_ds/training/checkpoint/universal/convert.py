"""Convert a DeepSpeed checkpoint into the universal form: atomically, validated, source untouched.

Two entry points:
  * `convert_checkpoint(SRC, OUT)` (`tools/convert_checkpoint.py --to universal SRC OUT`): OUT
    becomes a checkpoint root, `OUT/latest` -> `OUT/<tag>/` in universal form, which
    `--load OUT` resumes under any layout;
  * `ensure_converted(DIR, tag, ...)` (`--load DIR` of a checkpoint saved under another topology):
    rank 0 converts `DIR/<tag>` once into `DIR/<tag>.universal/` while the other ranks wait
    (bounded), then every rank reads its own part. A valid earlier conversion is reused.

Either way the output is written into a temporary directory next to the target, validated
(every tensor present with the shapes its config implies, every file of the size written), and
renamed into place only then; a failed or killed conversion leaves the source as it was and no
output (the next one clears the leftover temporary directory).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from megatron_ds import files
from megatron_ds.errors import UserError
from megatron_ds.training.checkpoint import reader
from megatron_ds.training.checkpoint.directory import (
    CONVERTED,
    LATEST,
    META,
    CheckpointError,
    converted_from,
    fingerprint,
)
from megatron_ds.training.checkpoint.rules import universal_refusal
from megatron_ds.training.checkpoint.universal import names, store
from megatron_ds.training.checkpoint.universal.deepspeed_source import DeepSpeedSource
from megatron_ds.training.checkpoint.universal.zero3_source import open_source

SUFFIX = ".universal"


@dataclass(frozen=True)
class Summary:
    source: str
    output: str
    tensors: int
    files: int
    bytes: int
    seconds: float

    def line(self) -> str:
        return (
            f"converted {self.source} to universal form {self.output}: {self.tensors} tensors "
            f"({self.files} files, {self.bytes / 2**20:.1f} MiB) in {self.seconds:.1f} s"
        )


def universal_path(load_dir: str, tag: str) -> str:
    """Where `--load DIR` puts the universal form of `DIR/<tag>`."""
    return os.path.join(os.path.abspath(load_dir), tag + SUFFIX)


def _open_source(path: str) -> DeepSpeedSource:
    ckpt = reader.open_checkpoint(path, moe=True)
    if store.is_universal(ckpt.meta):
        raise CheckpointError(f"{ckpt.directory}: already in universal form; --load it directly")
    if ckpt.meta.get(CONVERTED) is not None:
        raise CheckpointError(
            f"{ckpt.directory}: converted from {converted_from(ckpt.meta)}, its universal form is {ckpt.directory}{SUFFIX}; "
            f"--load it as it is"
        )
    refusal = universal_refusal(ckpt.meta, ckpt.directory)
    if refusal:
        raise CheckpointError(refusal)
    return open_source(ckpt)


def convert_checkpoint(source_path: str, output: str, show_progress: bool = True) -> Summary:
    """`source_path` (a checkpoint root or a global_step directory) -> OUT/latest + OUT/<tag>/."""
    source = _open_source(source_path)
    tag = source.ckpt.tag
    return _convert(source, output, "--to universal", tag, show_progress)


def _convert(source: DeepSpeedSource, output: str, flag: str, tag: str | None, show_progress: bool) -> Summary:
    """Write into a temporary directory, validate, rename; `tag` set: OUT is a root (`latest` + tag)."""
    start = time.monotonic()
    total = len(names.model_tensors(source.model))
    with files.atomic_directory(output, flag) as tmp:
        target = os.path.join(tmp, tag) if tag else tmp
        os.makedirs(target, exist_ok=True)
        bar = files.progress(total, "universal", show_progress)
        try:
            written = store.write(source, target, bar)
        finally:
            bar.close()
        store.Universal(target)  # validate before the output gets its name
        if tag:
            with open(os.path.join(tmp, LATEST), "w") as f:
                f.write(tag)
    seconds = time.monotonic() - start
    return Summary(
        source.ckpt.directory, os.path.abspath(output), written.tensors, written.files, written.bytes, seconds
    )


def _reusable(target: str, source_dir: str) -> bool:
    """A valid conversion of exactly this source exists at `target` (else an error says what to do)."""
    if not os.path.exists(target):
        return False
    found = store.Universal(target)  # a damaged one is refused here, never silently rebuilt
    if found.meta.get("source", {}).get("fingerprint") != fingerprint(os.path.join(source_dir, META)):
        raise CheckpointError(
            f"{target}: converted from another checkpoint than {source_dir}; delete it to convert again"
        )
    return True


def convert_next_to(load_dir: str, tag: str, show_progress: bool, log: Any = print) -> str:
    """Convert `DIR/<tag>` into `DIR/<tag>.universal` unless a valid conversion is there; its path."""
    source_dir = os.path.join(os.path.abspath(load_dir), tag)
    target = universal_path(load_dir, tag)
    if _reusable(target, source_dir):
        log(f"--load {load_dir} ({tag}): using its universal form {target}")
        return target
    ckpt = reader.open_checkpoint(source_dir, moe=True)
    if ckpt.meta.get(CONVERTED) is not None:
        raise CheckpointError(
            f"--load {load_dir} ({tag}): converted from {converted_from(ckpt.meta)}, its training state is in {target}, which "
            f"is missing; convert {ckpt.meta[CONVERTED].get('source')} again, or pass --no-load-optim (or --finetune) "
            f"to load its weights only"
        )
    source = open_source(ckpt)
    log(f"--load {load_dir} ({tag}): converting it once to universal form in {target}")
    try:
        summary = _convert(source, target, f"--load {load_dir}: its universal form", None, show_progress)
    except UserError as err:
        if os.access(os.path.dirname(target), os.W_OK):
            raise
        raise CheckpointError(
            f"{err}; convert it elsewhere with `python tools/convert_checkpoint.py --to universal {load_dir} OUT` "
            f"and --load OUT"
        ) from None
    log(summary.line())
    return target


_calls = [0]


def ensure_converted(load_dir: str, tag: str, timeout_s: float, show_progress: bool = False) -> str:
    """Collective: rank 0 runs `convert_next_to`; the others wait at most `timeout_s` for its verdict
    (through the process group's key-value store, so a long conversion trips no collective timeout)
    and raise the same one-line error if it failed."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    kv = _get_default_store()
    _calls[0] += 1  # every rank loads in the same order: the same key on every rank
    key = f"megatron_ds/universal/{_calls[0]}/{universal_path(load_dir, tag)}"
    if dist.get_rank() == 0:
        try:
            target = convert_next_to(load_dir, tag, show_progress)
        except BaseException as err:
            kv.set(key, f"error: {err}" if isinstance(err, UserError) else f"error: {type(err).__name__}: {err}")
            raise
        kv.set(key, "ok")
        return target
    try:
        kv.wait([key], timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - the store's timeout error type differs between torch versions
        raise CheckpointError(
            f"--load {load_dir} ({tag}): rank 0 did not finish converting it to universal form within "
            f"{timeout_s / 60:g} minutes; convert it first with `python tools/convert_checkpoint.py --to universal "
            f"{load_dir} OUT` and --load OUT, or raise --distributed-timeout-minutes"
        ) from None
    verdict = kv.get(key).decode()
    if verdict != "ok":
        raise CheckpointError(f"rank 0 could not convert --load {load_dir} ({tag}): {verdict.removeprefix('error: ')}")
    return universal_path(load_dir, tag)
