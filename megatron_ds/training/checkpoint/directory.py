"""Names and small helpers of the checkpoint directory layout, shared by saving, reading and
conversion (no torch.distributed, no DeepSpeed): `DIR/latest` names a tag, `DIR/<tag>/` holds
`megatron_ds.json` (written last) and the state files. See docs/checkpoints.md."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from typing import Any

from megatron_ds import files
from megatron_ds.errors import UserError

LATEST = "latest"
META = "megatron_ds.json"
TOKENIZER_DIR = "tokenizer"
"""`<checkpoint>/tokenizer/`: the tokenizer files an import copies beside the weights."""
UNIVERSAL_FORMAT = "megatron_ds.universal"
"""`format` of a universal checkpoint's metadata (`megatron_ds.training.checkpoint.universal.store`)."""
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's (and Megatron-DeepSpeed's) file naming the newest iteration in a checkpoint root."""
DEEPSPEED_MODEL_STATES = "mp_rank_00_model_states.pt"
"""DeepSpeed's per-stage engine file: every DeepSpeed checkpoint has one (ours too, beside META)."""
CONVERTED = "megatron_deepspeed"
"""Metadata section of a checkpoint converted from Megatron-DeepSpeed or Megatron-LM (`megatron_ds.interop`;
its `upstream` says which, Megatron-DeepSpeed when absent): per-spec weight files and `<tag>.universal/`,
no DeepSpeed engine or optimizer files of ours."""
CONVERT_MEGATRON_DEEPSPEED = "python tools/convert_checkpoint.py --from megatron-deepspeed"
CONVERT_MEGATRON_LM = "python tools/convert_checkpoint.py --from megatron-lm"
UPSTREAM_NAMES = {"megatron-deepspeed": "Megatron-DeepSpeed", "megatron-lm": "Megatron-LM", "hf": "Hugging Face"}


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
    files.fsync_directory(os.path.dirname(os.path.abspath(path)))


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(meta_path: str) -> str:
    """SHA-256 of a source checkpoint's metadata file: which checkpoint a conversion came from."""
    return sha256(meta_path)


def load_tag(load_dir: str, tag: str | None) -> str | None:
    """The checkpoint of `load_dir` to resume from: `tag` (`--load-tag`) when given, which must be complete,
    else the one `latest` names (`latest_tag`)."""
    if tag is None:
        return latest_tag(load_dir) if os.path.isdir(load_dir) else None
    if not os.path.isfile(os.path.join(load_dir, tag, META)):
        refuse_foreign(load_dir)
        found = complete_tags(load_dir)
        have = f"its last: {', '.join(found[-5:])}" if found else "it holds no complete checkpoint"
        raise CheckpointError(
            f"--load-tag {tag}: --load {load_dir} has no complete checkpoint {tag!r} ({have}); give one of them, or "
            "drop --load-tag to resume from latest"
        )
    return tag


def complete_tags(load_dir: str) -> list[str]:
    """The checkpoints of ours in `load_dir` (global_step directories with META), oldest first."""
    names = os.listdir(load_dir) if os.path.isdir(load_dir) else []
    return sorted((t for t in names if os.path.isfile(os.path.join(load_dir, t, META))), key=_natural)


def _natural(name: str) -> list:
    """Sort key: global_step9 before global_step10 (re.split alternates text and digit runs)."""
    return [int(part) if k % 2 else part for k, part in enumerate(re.split(r"(\d+)", name))]


def latest_pointer(directory: str) -> str | None:
    """What the `latest` file of `directory` names, as written (None without one); `latest_tag` checks it."""
    pointer = os.path.join(directory, LATEST)
    return open(pointer).read().strip() if os.path.isfile(pointer) else None


def latest_tag(load_dir: str) -> str | None:
    """The tag `latest` names, if it points at a complete checkpoint."""
    tag = latest_pointer(load_dir)
    if tag is None:
        refuse_foreign(load_dir)
        return None
    if not os.path.isfile(os.path.join(load_dir, tag, META)):
        refuse_foreign(load_dir)
        found = complete_tags(load_dir)
        give = (
            f", or resume from one of its last ({', '.join(found[-5:])}) with --load-tag"
            if found
            else " (it holds none)"
        )
        raise CheckpointError(
            f"--load {load_dir}: 'latest' names {tag!r}, which is incomplete or missing; point 'latest' at a "
            f"complete global_step directory{give}"
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


def foreign_checkpoint(path: str) -> str | None:
    """What `path` holds when it is a checkpoint root or global_step directory that DeepSpeed wrote but
    pretrain_gpt.py did not (no META): a description naming the files found, else None."""
    if os.path.isfile(os.path.join(path, DEEPSPEED_MODEL_STATES)) and not os.path.isfile(os.path.join(path, META)):
        step, root = path, os.path.dirname(os.path.abspath(path))
    else:
        tracker = os.path.join(path, MEGATRON_TRACKER)
        tag = latest_pointer(path) or ""
        if not tag and os.path.isfile(tracker):
            tag = "global_step" + open(tracker).read().strip()
        if not tag or not os.path.isfile(os.path.join(path, tag, DEEPSPEED_MODEL_STATES)):
            return None
        if os.path.isfile(os.path.join(path, tag, META)) or complete_tags(path):
            return None  # ours: a damaged tag beside complete ones is not another program's checkpoint
        step, root = os.path.join(path, tag), path
    megatron = os.path.isfile(os.path.join(root, MEGATRON_TRACKER))
    who = "a Megatron-DeepSpeed checkpoint" if megatron else "a DeepSpeed checkpoint that pretrain_gpt.py did not write"
    files = "layer and mp_rank" if glob.glob(os.path.join(step, "layer_*-model_*")) else "mp_rank"
    return f"{who} ({os.path.basename(step)}: DeepSpeed's {files} files, no {META})"


def megatron_lm_checkpoint(path: str) -> str | None:
    """What `path` holds when it is a Megatron-LM checkpoint root or iteration directory (the tracker
    naming an iter_NNNNNNN or release directory with torch_dist's metadata.json or `--ckpt-format
    torch`'s mp_rank_00 files): a description, else None."""
    step = path
    tracker = os.path.join(path, MEGATRON_TRACKER)
    if os.path.isfile(tracker) and not os.path.isfile(os.path.join(path, LATEST)):
        text = open(tracker).read().strip()
        step = os.path.join(path, "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else "")
    if os.path.isfile(os.path.join(step, "metadata.json")) and os.path.isfile(os.path.join(step, "common.pt")):
        return f"a Megatron-LM checkpoint ({os.path.basename(step)}: torch_dist)"
    if any(os.path.isfile(os.path.join(step, d, "model_optim_rng.pt")) for d in ("mp_rank_00", "mp_rank_00_000")):
        return f"a Megatron-LM checkpoint ({os.path.basename(step)}: --ckpt-format torch)"
    return None


def converted_from(meta: dict[str, Any]) -> str | None:
    """The upstream a converted checkpoint came from ("Megatron-LM"...), None when not converted."""
    section = meta.get(CONVERTED)
    if not isinstance(section, dict):
        return None
    upstream = section.get("upstream", "megatron-deepspeed")
    return UPSTREAM_NAMES.get(upstream, str(upstream))


def refuse_foreign(path: str) -> None:
    """Raise the one-line error for a checkpoint of Megatron-DeepSpeed, Megatron-LM (or another DeepSpeed program)."""
    found, convert = foreign_checkpoint(path), CONVERT_MEGATRON_DEEPSPEED
    if found is None:
        found, convert = megatron_lm_checkpoint(path), CONVERT_MEGATRON_LM
    if found is not None:
        raise CheckpointError(f"--load {path}: {found}; convert it first: {convert} {path} OUT, then --load OUT")


IMPORTS = ("hf", CONVERTED)
"""Metadata sections of imported checkpoints (`megatron_ds.interop`); each records `vocab_size`,
the tokenizer's rows (the rest is `--make-vocab-size-divisible-by` padding)."""


def recorded_vocab_size(meta: dict[str, Any]) -> int | None:
    """The unpadded vocabulary a checkpoint recorded, if any: an import's (its source's tokenizer), else the
    training run's (its config's `data.unpadded_vocab_size`: `--vocab-size` or the tokenizer's size)."""
    imported = next(
        (meta[k]["vocab_size"] for k in IMPORTS if isinstance(meta.get(k), dict) and meta[k].get("vocab_size")), None
    )
    if imported:
        return imported
    data = meta.get("config", {}).get("data", {}) if isinstance(meta.get("config"), dict) else {}
    trained = data.get("unpadded_vocab_size") if isinstance(data, dict) else None
    return trained if isinstance(trained, int) and trained > 0 else None
