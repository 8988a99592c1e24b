"""Names and small helpers of the checkpoint directory layout, shared by saving, reading and
conversion (no torch.distributed, no DeepSpeed): `DIR/latest` names a tag, `DIR/<tag>/` holds
`megatron_ds.json` (written last) and the state files. See docs/checkpoints.md."""

from __future__ import annotations

import json
import os
from typing import Any

from megatron_ds.errors import UserError

LATEST = "latest"
META = "megatron_ds.json"
TOKENIZER_DIR = "tokenizer"
"""`<checkpoint>/tokenizer/`: the tokenizer files an import copies beside the weights."""
UNIVERSAL_FORMAT = "megatron_ds.universal"
"""`format` of a universal checkpoint's metadata (`megatron_ds.training.checkpoint.universal.store`)."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used as asked; the message names the directory and the fix."""


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename (never a half-written file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest_tag(load_dir: str) -> str | None:
    """The tag `latest` names, if it points at a complete checkpoint."""
    pointer = os.path.join(load_dir, LATEST)
    if not os.path.isfile(pointer):
        return None
    tag = open(pointer).read().strip()
    if not os.path.isfile(os.path.join(load_dir, tag, META)):
        raise CheckpointError(
            f"--load {load_dir}: 'latest' names {tag!r}, which is incomplete or missing; "
            f"point 'latest' at a complete global_step directory"
        )
    return tag


def read_meta(load_dir: str, tag: str) -> dict[str, Any]:
    path = os.path.join(load_dir, tag, META)
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable ({err}); the checkpoint is damaged") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"{path}: no 'config' section; the checkpoint is damaged")
    return meta
