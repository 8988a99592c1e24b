"""A `--load` directory without a checkpoint: a first launch, or something else by mistake.

Megatron-DeepSpeed's launch scripts pass the same directory as `--save` and `--load`, so the first
launch finds nothing to resume and starts from scratch (Megatron prints a warning and carries on).
We do the same, with one NOTICE line, when the directory does not exist or holds nothing but what
an earlier launch of ours leaves before its first checkpoint (hidden names: a crashed save's
`.incomplete.*`, a write probe; DeepSpeed's `zero_to_fp32.py` and `zero_to_torch.py`, which a ZeRO save
copies in before the checkpoint). A directory that holds anything else but no `latest` file is an
error naming what it found: a typo'd path or a parent directory would otherwise silently train a
new model over the old one's schedule. `--exit-on-missing-checkpoint` makes the first case an
error too, as in Megatron. Pure: the standard library only.
"""

from __future__ import annotations

import os

from megatron_ds.training.checkpoint.directory import LATEST, META, CheckpointError

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's tracker file (Megatron-LM, and Megatron-DeepSpeed beside DeepSpeed's `latest`)."""
_SHOWN = 4
"""Entries named in the error; the rest are counted."""
DEEPSPEED_RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
"""What DeepSpeed's ZeRO save copies into the save directory itself before it writes the checkpoint
(`DeepSpeedEngine._copy_recovery_script`): a first save that failed leaves them without `latest`."""


def first_launch_notice(load_dir: str, finetune: bool = False) -> str:
    """The one line a first launch prints (rank 0); a warning with `--finetune`, which has nothing to start from."""
    if finetune:
        return (
            f"WARNING: --finetune --load {load_dir}: no checkpoint there, so nothing is fine-tuned: the weights start "
            f"random, as Megatron-DeepSpeed carries on (--exit-on-missing-checkpoint makes this an error)"
        )
    return (
        f"NOTICE: --load {load_dir} holds no checkpoint yet: starting from scratch, as Megatron-DeepSpeed does "
        f"(--exit-on-missing-checkpoint makes this an error)"
    )


def check_without_checkpoint(load_dir: str, exit_on_missing: bool, finetune: bool = False) -> str:
    """For a `--load` without `latest`: the first-launch notice, or a CheckpointError naming what the
    directory holds instead (or `--exit-on-missing-checkpoint`'s refusal)."""
    if os.path.exists(load_dir) and not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: a file, not a directory; give the checkpoint directory")
    found = unexpected_entries(load_dir)
    if "config.json" in found:  # a Hugging Face model directory
        raise CheckpointError(
            f"--load {load_dir}: a Hugging Face model directory (config.json), not a checkpoint; import it first: "
            f"python tools/convert_checkpoint.py --from hf {load_dir} OUT, then --load OUT with the flags it prints"
        )
    if META in found:  # one tag's directory (global_stepN/)
        parent, name = os.path.split(os.path.normpath(load_dir))
        raise CheckpointError(
            f"--load {load_dir}: the directory of one checkpoint, not of the checkpoints; give --load {parent} "
            f"--load-tag {name}"
        )
    if found:
        raise CheckpointError(
            f"--load {load_dir}: no checkpoint (no 'latest' file) but it holds {_describe(load_dir, found)}; "
            f"give the directory that holds 'latest', or an empty or new directory to start from scratch"
        )
    if exit_on_missing:
        raise CheckpointError(
            f"--load {load_dir}: no checkpoint yet and --exit-on-missing-checkpoint is given; check the path, "
            f"or drop the flag to start from scratch"
        )
    return first_launch_notice(load_dir, finetune)


def unexpected_entries(load_dir: str) -> list[str]:
    """Sorted names in `load_dir` other than leftovers of a launch that had not saved its first checkpoint: hidden
    names of ours and DeepSpeed's recovery scripts ([] when it does not exist)."""
    if not os.path.isdir(load_dir):
        return []
    leftovers = set(DEEPSPEED_RECOVERY_SCRIPTS)
    return sorted(name for name in os.listdir(load_dir) if not name.startswith(".") and name not in leftovers)


def _describe(load_dir: str, names: list[str]) -> str:
    shown = [_entry(load_dir, n) for n in names[:_SHOWN]]
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(shown) + more


def _entry(load_dir: str, name: str) -> str:
    """One entry, with what it looks like when that says how to fix the path."""
    path = os.path.join(load_dir, name)
    if not os.path.isdir(path):
        if name == MEGATRON_TRACKER:
            return f"{name} (Megatron's checkpoint tracker: a Megatron checkpoint, not one of ours)"
        return name
    if os.path.isfile(os.path.join(path, LATEST)):
        return f"{name}/ (it holds 'latest': --load {path}?)"
    if os.path.isfile(os.path.join(path, META)):
        return f"{name}/ (a checkpoint of ours without 'latest': write '{name}' into {os.path.join(load_dir, LATEST)})"
    return f"{name}/"
