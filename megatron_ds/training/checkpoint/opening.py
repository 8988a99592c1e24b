"""Opening one of our checkpoints by its metadata alone (no torch): `DIR/latest` -> `DIR/global_stepN/megatron_ds.json`,
its `Config`, and the one-line errors for what is not one of ours. `reader` reads the tensors; the planner reads a
teacher's sizes here (`training/checkpoint/teacher.py`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from megatron_ds.config import Config
from megatron_ds.training.checkpoint.directory import LATEST, META, CheckpointError, latest_tag, read_meta
from megatron_ds.training.checkpoint.rules import moe_refusal


def read_config(meta: dict[str, Any]) -> Config:
    """The `Config` a checkpoint was written with (the one place that reads its layout)."""
    return Config.from_dict(meta["config"])


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint directory and what its metadata says."""

    root: str
    """The directory holding `latest` (what `--save`/`--load` name)."""
    tag: str
    """The `global_stepN` sub-directory."""
    meta: dict[str, Any]
    config: Config

    @property
    def directory(self) -> str:
        return os.path.join(self.root, self.tag)

    @property
    def tensor_parallel(self) -> int:
        return self.config.parallel.tensor_model_parallel_size


def open_checkpoint(path: str, moe: bool = False) -> Checkpoint:
    """A checkpoint from its root directory (uses `latest`) or from a `global_stepN` directory. A mixture-of-experts
    checkpoint only with `moe` (the universal conversion, a `--kd` teacher, inference and the Hugging Face export, which
    read DeepSpeed's MoE files); else it is refused in one line (`rules.moe_refusal`): the per-spec readers do not."""
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, META)):
        root, tag = os.path.split(path)
    elif os.path.isdir(path):
        root, tag = path, latest_tag(path)
        if tag is None and os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointError(
                f"{path}: a Hugging Face model directory (config.json), not a checkpoint; import it first with "
                f"python tools/convert_checkpoint.py --from hf {path} OUT"
            )
        if tag is None:
            raise CheckpointError(
                f"{path}: no checkpoint here (no '{LATEST}' file and no {META}); give a directory "
                f"written by pretrain_gpt.py --save, or one of its global_step directories"
            )
    else:
        what = "a file, not a directory" if os.path.isfile(path) else "no such directory"
        raise CheckpointError(f"{path}: {what}; give a checkpoint directory")
    meta = read_meta(root, tag)  # its own one-line errors, not wrapped again below
    try:
        config = read_config(meta)
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{os.path.join(root, tag, META)}: unreadable ({err}); the checkpoint is damaged"
        ) from None
    refusal = None if moe else moe_refusal(meta, os.path.join(root, tag))
    if refusal:
        raise CheckpointError(refusal)
    return Checkpoint(root, tag, meta, config)
