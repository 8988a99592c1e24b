"""Checkpoints through DeepSpeed's engine, written atomically, validated before loading.

Layout of `--save DIR`:
    DIR/latest                      the tag of the newest complete checkpoint (replaced atomically)
    DIR/global_step<N>/             DeepSpeed's files: one `layer_XX-model_00-model_states.pt` per
                                    spec index (layout-independent), per-stage optimizer/ZeRO files
    DIR/global_step<N>/megatron_ds.json   config, train state, layout (written last by rank 0)
    DIR/global_step<N>/rng_rank<R>.pt     each rank's RNG states

A weights-only checkpoint (`"weights_only": true` in megatron_ds.json, as `megatron_ds.interop`'s
Hugging Face import writes) has only the per-spec files: it loads like `--finetune` (iteration
0, fresh optimizer and schedule) at any P, DP and layout, without a flag.

A checkpoint is written under a temporary name and renamed once every rank has finished; only
then does `latest` name it, so a crash mid-save never leaves a half checkpoint as latest, and an
existing checkpoint is never overwritten (a second save at the same step gets a new tag).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from megatron_ds.config import Config
from megatron_ds.errors import UserError
from megatron_ds.pipeline.layout import Layout
from megatron_ds.training.state import TrainState

LATEST = "latest"
META = "megatron_ds.json"


class CheckpointError(UserError):
    """A checkpoint that cannot be used as asked; the message names the directory and the fix."""


def check_writable(save_dir: str) -> None:
    """`--save` must be creatable and writable; checked before training starts."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        probe = os.path.join(save_dir, f".write_probe_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"--save {save_dir}: not writable ({e.strerror}); choose a writable directory") from None


def _write_atomic(path: str, text: str) -> None:
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
    with open(os.path.join(load_dir, tag, META)) as f:
        return json.load(f)


def _free_tag(save_dir: str, iteration: int) -> str:
    tag, n = f"global_step{iteration}", 1
    while os.path.exists(os.path.join(save_dir, tag)):
        n += 1
        tag = f"global_step{iteration}.{n}"
    return tag


def _rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(engine: Any, config: Config, layout: Layout, state: TrainState, save_dir: str) -> str:
    """Save on every rank (collective); returns the tag written."""
    import torch.distributed as dist

    rank = dist.get_rank()
    tag_box = [_free_tag(save_dir, state.iteration) if rank == 0 else None]
    dist.broadcast_object_list(tag_box, src=0)
    tag = tag_box[0]
    tmp_tag = f".incomplete.{tag}"
    engine.save_checkpoint(save_dir, tag=tmp_tag, save_latest=False)  # ends with a barrier
    torch.save(_rng_state(), os.path.join(save_dir, tmp_tag, f"rng_rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        meta = {
            "config": config.to_dict(),
            "train_state": asdict(state),
            "layout": layout.to_string(),
            "world_size": dist.get_world_size(),
            "format": 1,
        }
        _write_atomic(os.path.join(save_dir, tmp_tag, META), json.dumps(meta, indent=1))
        os.replace(os.path.join(save_dir, tmp_tag), os.path.join(save_dir, tag))
        _write_atomic(os.path.join(save_dir, LATEST), tag)
    dist.barrier()
    return tag


WEIGHT_FREE_FIELDS = ("seq_length",)
"""Architecture fields that shape no weight: a weights-only checkpoint (an import) may be trained on
with other values. (Dropout and init std are not architecture at all: `regularization_changes`.)"""


def is_weights_only(meta: dict[str, Any]) -> bool:
    """The checkpoint holds model weights only (no optimizer, schedule or RNG state)."""
    return bool(meta.get("weights_only", False))


def architecture_mismatch(saved: dict[str, Any], config: Config) -> list[str]:
    """Architecture (`ModelConfig`) fields that differ between a checkpoint's config and this run's.

    Regularization (dropout, init std) is not architecture: see `regularization_changes`.
    """
    ours = config.to_dict()["model"]
    # Through from_dict, fields added after the checkpoint was written take their defaults.
    theirs = Config.from_dict(saved["config"]).to_dict()["model"]
    free = WEIGHT_FREE_FIELDS if is_weights_only(saved) else ()
    return [
        f"{k} {theirs.get(k)!r} (checkpoint) vs {v!r} (now)"
        for k, v in ours.items()
        if theirs.get(k) != v and k not in free
    ]


def regularization_changes(saved: dict[str, Any], config: Config) -> list[str]:
    """`RegularizationConfig` fields this run changes relative to the checkpoint (allowed on resume)."""
    ours = config.to_dict()["regularization"]
    theirs = Config.from_dict(saved["config"]).to_dict()["regularization"]
    return [f"{k} {theirs[k]!r} -> {v!r}" for k, v in ours.items() if theirs[k] != v]


def regularization_notice(saved: dict[str, Any], config: Config, load_dir: str, tag: str) -> str | None:
    """The one-line notice printed on resume when dropout or init std differ from the checkpoint's."""
    changes = regularization_changes(saved, config)
    if not changes:
        return None
    return f"NOTICE: --load {load_dir} ({tag}): regularization differs from the checkpoint's: {'; '.join(changes)}"


def check_compatible(meta: dict[str, Any], config: Config, load_dir: str, tag: str) -> None:
    """Refuse a checkpoint whose weights cannot be loaded into this model at all."""
    mismatch = architecture_mismatch(meta, config)
    if mismatch:
        raise CheckpointError(
            f"--load {load_dir} ({tag}) has another architecture: {'; '.join(mismatch)}; "
            f"use matching model flags or another --load directory"
        )
    ck = config.checkpoint
    if (
        config.training.precision == "bf16"
        and config.training.zero_stage == 0
        and not (ck.no_load_optim or ck.finetune or is_weights_only(meta))
    ):
        # DeepSpeed 0.19.8's BF16_Optimizer fails to read its own optimizer state back (KeyError in
        # _load_legacy_checkpoint); refuse up front instead of crashing after start-up.
        raise CheckpointError(
            f"--load {load_dir} ({tag}) with --bf16 and --zero-stage 0: DeepSpeed cannot restore "
            f"this optimizer state; train bf16 with --zero-stage 1, or pass --no-load-optim"
        )
    saved_t = meta["config"].get("parallel", {}).get("tensor_model_parallel_size", 1)
    t = config.parallel.tensor_model_parallel_size
    if saved_t != t:
        raise CheckpointError(
            f"--load {load_dir} ({tag}) was saved with --tensor-model-parallel-size {saved_t} but this run uses {t}: "
            f"its layers are stored as {saved_t} tensor-parallel shards and are not resharded on load (not even "
            f"with --no-load-optim or --finetune); rerun with --tensor-model-parallel-size {saved_t}"
        )


def _same_topology(meta: dict[str, Any], config: Config, layout: Layout, world_size: int) -> list[str]:
    saved = Config.from_dict(meta["config"])
    diffs = []
    if meta["layout"] != layout.to_string():
        diffs.append(f"layout {meta['layout']} vs {layout.to_string()}")
    if meta.get("world_size") != world_size:
        diffs.append(f"world size {meta.get('world_size')} vs {world_size}")
    for name in ("tensor_model_parallel_size", "data_parallel_size"):
        a, b = getattr(saved.parallel, name), getattr(config.parallel, name)
        if a != b:
            diffs.append(f"{name} {a} vs {b}")
    if saved.training.zero_stage != config.training.zero_stage:
        diffs.append(f"zero stage {saved.training.zero_stage} vs {config.training.zero_stage}")
    if saved.training.precision != config.training.precision:
        diffs.append(f"precision {saved.training.precision} vs {config.training.precision}")
    return diffs


def check_dirs(config: Config) -> None:
    """--save is writable; --load holds a checkpoint of this architecture (or --load-optional)."""
    ck = config.checkpoint
    if ck.save:
        check_writable(ck.save)
    if not ck.load:
        return
    tag = latest_tag(ck.load) if os.path.isdir(ck.load) else None
    if tag is None:
        if not ck.load_optional:
            raise CheckpointError(
                f"--load {ck.load}: no checkpoint found (no 'latest' file); check the path, or pass "
                f"--load-optional to start fresh when none exists yet"
            )
        return
    check_compatible(read_meta(ck.load, tag), config, ck.load, tag)


def load(engine: Any, config: Config, layout: Layout, load_dir: str) -> TrainState | None:
    """Resume from `latest` in `load_dir`; None when there is nothing to load and that is allowed."""
    import torch.distributed as dist

    ck = config.checkpoint
    check_dirs(config)  # again: the directory may have changed since start-up
    tag = latest_tag(load_dir) if os.path.isdir(load_dir) else None
    if tag is None:
        return None
    meta = read_meta(load_dir, tag)
    check_compatible(meta, config, load_dir, tag)  # load_dir need not be --load (library callers)
    notice = regularization_notice(meta, config, load_dir, tag)
    if notice and dist.get_rank() == 0:
        print(notice, flush=True)
    weights_only = ck.no_load_optim or ck.finetune or is_weights_only(meta)
    moved = _same_topology(meta, config, layout, dist.get_world_size())
    if moved and not weights_only:
        raise CheckpointError(
            f"--load {load_dir} ({tag}) was saved with {'; '.join(moved)}: model weights carry "
            f"over, optimizer state does not; pass --no-load-optim (or --finetune) to load the "
            f"weights only"
        )
    if weights_only:
        engine.module.load_state_dir(os.path.join(load_dir, tag), checkpoint_engine=engine.checkpoint_engine)
        if getattr(engine.optimizer, "refresh_fp32_params", None) is not None:
            # ZeRO and bf16/fp16 optimizers keep their own fp32 copy of the weights, made when the
            # engine was built; without this the first step would write the initial weights back.
            engine.optimizer.refresh_fp32_params()
        if is_weights_only(meta) and dist.get_rank() == 0:
            print(f"--load {load_dir} ({tag}) holds weights only: optimizer and learning-rate schedule start fresh")
    else:
        engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    rng_file = os.path.join(load_dir, tag, f"rng_rank{dist.get_rank()}.pt")
    if not moved and not ck.no_load_rng and not ck.finetune and os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    if ck.finetune or is_weights_only(meta):
        return TrainState()
    return TrainState(**meta["train_state"])


def remove_incomplete(save_dir: str) -> None:
    """Delete leftovers of a crashed save (rank 0, before training)."""
    if not os.path.isdir(save_dir):
        return
    for name in os.listdir(save_dir):
        if name.startswith(".incomplete."):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
