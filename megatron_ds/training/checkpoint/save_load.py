"""Checkpoints through DeepSpeed's engine, written atomically, validated before loading.

Layout of `--save DIR` (docs/checkpoints.md has every file):
    DIR/latest                      the tag of the newest complete checkpoint (replaced atomically)
    DIR/global_step<N>/             DeepSpeed's files: one `layer_XX-model_RR-model_states.pt` per
                                    spec index and tensor rank (layout-independent), per-stage
                                    optimizer/ZeRO files
    DIR/global_step<N>/megatron_ds.json   config, train state, layout (written last by rank 0)
    DIR/global_step<N>/rng_rank<R>.pt     each rank's RNG states
    DIR/global_step<N>.universal/   written by a `--load` under another topology: the universal form

`load` resumes the whole training state under the saved topology (DeepSpeed's own load) or under
any other P, layout, T, DP size, ZeRO stage or precision (through the universal form,
`megatron_ds.training.checkpoint.universal`); what may not change is in `rules`.

A weights-only checkpoint (`"weights_only": true` in megatron_ds.json, as `megatron_ds.interop`'s
Hugging Face import writes) has only the per-spec files: it loads like `--finetune` (iteration
0, fresh optimizer and schedule) at any P, T, DP and layout, without a flag.

A checkpoint is written under a temporary name and renamed once every rank has finished; only
then does `latest` name it, so a crash mid-save never leaves a half checkpoint as latest, and an
existing checkpoint is never overwritten (a second save at the same step gets a new tag).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from megatron_ds import files
from megatron_ds.config import Config
from megatron_ds.estimate.compute import model_flops_per_iteration
from megatron_ds.pipeline.layout import Layout
from megatron_ds.training.checkpoint import experts, first_launch, reader
from megatron_ds.training.checkpoint.directory import (
    LATEST,
    META,
    CheckpointError,
    converted_from,
    latest_pointer,
    load_tag,
    read_meta,
    write_atomic,
)
from megatron_ds.training.checkpoint.rank_files import check_layer_files, check_rank_files
from megatron_ds.training.checkpoint.rules import (
    check_compatible,
    deepspeed_cannot_restore,
    has_optimizer_state,
    is_weights_only,
    moe_pipeline_refusal,
    precision_notice,
    regularization_notice,
    topology_changes,
    universal_refusal,
    vocabulary_notice,
    weight_free_notice,
)
from megatron_ds.training.checkpoint.tokenizer_check import tokenizer_notice
from megatron_ds.training.checkpoint.universal import restore, store
from megatron_ds.training.checkpoint.universal.convert import SUFFIX as UNIVERSAL_SUFFIX
from megatron_ds.training.checkpoint.universal.convert import ensure_converted
from megatron_ds.training.checkpoint.universal.deepspeed_source import FP32
from megatron_ds.training.optimizer import refresh_fp32_copies
from megatron_ds.training.rank_agreement import fail_together
from megatron_ds.training.state import TrainState


def check_writable(save_dir: str, create: bool = True) -> None:
    """`--save` must be creatable and writable; checked before training starts. `create=False`
    (`--print-layout`, a dry run) creates nothing: the nearest existing directory must be writable."""
    files.check_writable_directory("--save", save_dir, create, CheckpointError)


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
    if config.checkpoint.no_save_optim:  # --no-save-optim: DeepSpeed's per-spec weight files alone
        engine.module.save_state_dict(os.path.join(save_dir, tmp_tag), checkpoint_engine=engine.checkpoint_engine)
        dist.barrier()
    else:
        engine.save_checkpoint(save_dir, tag=tmp_tag, save_latest=False)  # ends with a barrier
    torch.save(_rng_state(), os.path.join(save_dir, tmp_tag, f"rng_rank{rank}.pt"))
    if config.model.is_moe:  # where each expert's optimizer state is, for the universal form
        records: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(records, experts.rank_record(engine, config.parallel.expert_parallel_size))
        if rank == 0:
            experts.write(os.path.join(save_dir, tmp_tag), records)
    dist.barrier()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        # one process per node flushes what its node wrote (a node's page cache holds it) before the rename
        # publishes the checkpoint: a power cut must not leave `latest` naming empty or torn files
        files.fsync_tree(os.path.join(save_dir, tmp_tag))
    dist.barrier()
    if rank == 0:
        meta = {
            "config": config.to_dict(),
            "train_state": asdict(state),
            "layout": layout.to_string(),
            "world_size": dist.get_world_size(),
            "format": 1,
            "optimizer_state": not config.checkpoint.no_save_optim,
        }
        write_atomic(os.path.join(save_dir, tmp_tag, META), json.dumps(meta, indent=1))
        previous = latest_pointer(save_dir)
        os.replace(os.path.join(save_dir, tmp_tag), os.path.join(save_dir, tag))
        files.fsync_directory(save_dir)  # the rename is on the device before `latest` names it
        write_atomic(os.path.join(save_dir, LATEST), tag)
        if config.checkpoint.save_retain_interval and previous not in (None, tag):
            _retire(save_dir, previous, config.checkpoint.save_retain_interval)
    dist.barrier()
    return tag


def save_failed(save_dir: str, iteration: int, failure: str) -> CheckpointError:
    """One line for a save that could not be written (`files.write_failure`); the previous checkpoint stays, since
    `latest` moves last."""
    last = latest_pointer(save_dir)
    kept = f"the last checkpoint, {last}, is kept" if last else "no earlier checkpoint there"
    return CheckpointError(
        f"--save {save_dir}: writing the checkpoint of iteration {iteration} failed ({failure}"
        f"{files.free_space(save_dir)}); {kept}: free space or fix the directory, then relaunch to resume from it"
    )


def _retire(save_dir: str, tag: str, retain_interval: int) -> None:
    """`--save-retain-interval`: delete the checkpoint `tag` that `latest` named before this save, now that the
    new one is complete and `latest` names it, unless its iteration is a multiple of `retain_interval`; a symbolic
    link, or anything but a complete checkpoint of ours, is kept (as Megatron-LM keeps links)."""
    path = os.path.join(save_dir, tag)
    if os.path.islink(path) or not os.path.isfile(os.path.join(path, META)):
        return
    try:
        iteration = int(read_meta(save_dir, tag)["train_state"]["iteration"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        return  # damaged: not ours to delete
    if iteration % retain_interval:
        shutil.rmtree(path)
        universal = path + UNIVERSAL_SUFFIX  # its universal form, converted from it for a resume at another layout
        also = f" and its universal form {universal}" if os.path.isdir(universal) else ""
        if also:
            shutil.rmtree(universal)
        print(
            f"deleted checkpoint {path}{also} (iteration {iteration}: not a multiple of --save-retain-interval "
            f"{retain_interval})",
            flush=True,
        )


def check_dirs(config: Config, dry_run: bool = False) -> list[str]:
    """--save is writable (created unless `dry_run`); --load holds a checkpoint of this architecture,
    or nothing yet (a first launch: `first_launch`). Returns the notices to print (rank 0)."""
    ck = config.checkpoint
    if ck.save:
        check_writable(ck.save, create=not dry_run)
    if not ck.load:
        return []
    tag = load_tag(ck.load, ck.load_tag)
    if tag is None:
        return [first_launch.check_without_checkpoint(ck.load, ck.exit_on_missing_checkpoint, ck.finetune)]
    meta = read_meta(ck.load, tag)
    check_compatible(meta, config, ck.load, tag)
    if store.is_universal(meta):
        store.Universal(os.path.join(ck.load, tag))  # complete and undamaged, before any process group
    notice = tokenizer_notice(meta, config, ck.load, tag)
    return [notice] if notice else []


def load(engine: Any, config: Config, layout: Layout, load_dir: str) -> TrainState | None:
    """Resume from `latest` in `load_dir`; None when there is nothing to load yet (a first launch).

    Saved under this very topology: DeepSpeed loads its own files (and each rank's RNG state).
    Under another P, layout, T, DP, ZeRO stage or precision, or from a universal checkpoint: the
    whole training state through the universal form (converted once next to the source). Weights
    only (`--no-load-optim`, `--finetune`, imports): from the per-spec files, resharded for T.
    """
    import torch.distributed as dist

    ck = config.checkpoint
    check_dirs(config)  # again: the directory may have changed since start-up
    tag = load_tag(load_dir, ck.load_tag if load_dir == ck.load else None)
    if tag is None:
        return None
    meta = read_meta(load_dir, tag)
    check_compatible(meta, config, load_dir, tag)  # load_dir need not be --load (library callers)
    rank0 = dist.get_rank() == 0
    weights_only = ck.no_load_optim or ck.finetune or not has_optimizer_state(meta)
    universal = store.is_universal(meta)
    moved = ["universal form"] if universal else topology_changes(meta, config, layout, dist.get_world_size())
    refusal = moe_pipeline_refusal(meta, config, moved, f"--load {load_dir} ({tag})")
    if refusal:
        raise CheckpointError(refusal)
    if rank0:
        _print_notices(meta, config, load_dir, tag, weights_only)
    if weights_only:
        _load_weights(engine, config, layout, load_dir, tag, meta, bool(moved))
        if not (ck.finetune or is_weights_only(meta)):  # the iteration is kept: so are the dropout masks' indices
            state = meta["train_state"]
            engine.global_steps, engine.global_samples = state["iteration"], state["consumed_train_samples"]
        if is_weights_only(meta) and rank0:
            print(f"--load {load_dir} ({tag}) holds weights only: optimizer and learning-rate schedule start fresh")
    elif moved or deepspeed_cannot_restore(config):
        _load_universal(engine, config, layout, load_dir, tag, meta, moved)
    else:
        check_rank_files(engine, config, load_dir, tag)
        engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    rng_file = os.path.join(load_dir, tag, f"rng_rank{dist.get_rank()}.pt")
    rng_state = None if moved or ck.no_load_rng or ck.finetune else _read_rng_state(rng_file)  # every rank or none
    if rng_state is not None:
        _set_rng_state(rng_state)
    if ck.finetune or is_weights_only(meta):
        return TrainState()
    if ck.reset_iteration:  # Megatron-DeepSpeed: iteration and consumed samples from 0, the rest resumed
        engine.global_steps = engine.global_samples = 0
        return TrainState()
    return _saved_state(meta, config)


def _print_notices(meta: dict[str, Any], config: Config, load_dir: str, tag: str, weights_only: bool) -> None:
    """What differs between the checkpoint and this run that the resume accepts, each said once (rank 0)."""
    for notice in (
        regularization_notice(meta, config, load_dir, tag),
        weight_free_notice(meta, config, load_dir, tag),
        vocabulary_notice(meta, config, load_dir, tag),
        None if weights_only else precision_notice(meta, config, load_dir, tag),
        *resume_flag_notices(meta, config, load_dir, tag),
    ):
        if notice:
            print(notice, flush=True)


def _load_universal(
    engine: Any, config: Config, layout: Layout, load_dir: str, tag: str, meta: dict[str, Any], moved: list[str]
) -> None:
    """The whole training state through the universal form: the checkpoint itself when it is one, else its
    conversion (made once, beside it, by rank 0; the others wait for it)."""
    import torch.distributed as dist

    universal = store.is_universal(meta)
    refusal = None if universal else universal_refusal(meta, f"--load {load_dir} ({tag})")
    if refusal:
        raise CheckpointError(refusal)
    if dist.get_rank() == 0 and not universal:
        print(
            f"--load {load_dir} ({tag}) was saved with {'; '.join(moved) or 'bf16 without ZeRO'}: resuming "
            f"the whole training state through its universal form",
            flush=True,
        )
    path = (
        os.path.join(load_dir, tag)
        if universal
        else ensure_converted(load_dir, tag, 60.0 * config.parallel.distributed_timeout_minutes, show_progress=True)
    )
    restore.load_training_state(engine, config, layout, store.Universal(path))


def _saved_state(meta: dict[str, Any], config: Config) -> TrainState:
    """The run state the checkpoint recorded; one written before the token and FLOP counts existed (every step
    then kept whole samples) gets them from its consumed samples."""
    saved = dict(meta["train_state"])
    saved.setdefault("consumed_train_tokens", saved.get("consumed_train_samples", 0) * config.model.seq_length)
    saved.setdefault(
        "floating_point_operations_so_far",
        float(model_flops_per_iteration(config.model, saved.get("consumed_train_samples", 0))),
    )
    return TrainState(**saved)


def _read_rng_state(path: str) -> dict[str, Any] | None:
    """This rank's RNG state file (None when it has none), read on every rank at once (`fail_together`): a damaged
    one stops them all."""
    with fail_together():
        if not os.path.isfile(path):
            return None
        try:
            return torch.load(path, weights_only=False)  # python's and numpy's states are pickled objects
        except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError) as err:
            raise CheckpointError(
                files.load_failure(path, err, "resume from another checkpoint (--load-tag), or give --no-load-rng")
            ) from None


def resume_flag_notices(meta: dict[str, Any], config: Config, load_dir: str, tag: str) -> list[str]:
    """The NOTICE lines of resume flags whose meaning here differs in form from Megatron-DeepSpeed's."""
    ck, where = config.checkpoint, f"--load {load_dir} ({tag})"
    out = []
    if not has_optimizer_state(meta) and not is_weights_only(meta):
        out.append(f"NOTICE: {where} was saved with --no-save-optim: optimizer and learning-rate schedule start fresh")
    elif ck.no_load_optim and not ck.finetune:
        out.append(
            f"NOTICE: --no-load-optim: {where}'s weights, iteration and consumed samples are loaded, its optimizer "
            f"and learning-rate schedule are not (Megatron-DeepSpeed's DeepSpeed path would load them anyway)"
        )
    elif ck.no_load_lr_state and not ck.finetune:
        out.append(
            f"NOTICE: --no-load-lr-state: the learning-rate schedule starts again from step 0; Megatron-DeepSpeed "
            f"declares this flag but never reads it (it would resume {where}'s schedule)"
        )
    return out


def _load_weights(
    engine: Any, config: Config, layout: Layout, load_dir: str, tag: str, meta: dict[str, Any], moved: bool
) -> None:
    """Model weights only: DeepSpeed's per-spec files at the saved T, else full tensors resharded (a mixture of experts
    from its universal form when converted, or `moved` into or out of pipeline stages)."""
    directory = os.path.join(load_dir, tag)
    moe = getattr(engine.module, "moe_layers", None)
    saved_p = Config.from_dict(meta["config"]).parallel.pipeline_model_parallel_size
    # DeepSpeed reads its MoE files into the engine that saved them only: the plain one's at P = 1, each stage's at P > 1
    staged = moved and max(saved_p, config.parallel.pipeline_model_parallel_size) > 1
    if store.is_universal(meta) or (moe and (converted_from(meta) is not None or staged)):
        # a converted mixture-of-experts checkpoint holds no DeepSpeed files: its weights are in its universal form
        timeout = 60.0 * config.parallel.distributed_timeout_minutes
        found = store.Universal(directory if store.is_universal(meta) else ensure_converted(load_dir, tag, timeout))
        restore.load_weights(engine, config, layout, lambda t: found.read(t.name, FP32))
        return
    if moe:  # DeepSpeed's MoE files: the weights alone, each expert's own file
        check_rank_files(engine, config, load_dir, tag, weights_only=True)
        engine.load_checkpoint(
            load_dir, tag=tag, load_module_only=True, load_optimizer_states=False, load_lr_scheduler_states=False
        )
        return
    saved_t = Config.from_dict(meta["config"]).parallel.tensor_model_parallel_size
    if saved_t == config.parallel.tensor_model_parallel_size:
        with fail_together():  # each stage reads its own layer files; loading them ties weights (collective)
            check_layer_files(engine, directory)
        engine.module.load_state_dir(directory, checkpoint_engine=engine.checkpoint_engine)
        refresh_fp32_copies(engine.optimizer)
        return
    ckpt = reader.open_checkpoint(directory)
    restore.load_weights(engine, config, layout, lambda t: reader.read_spec_tensor(ckpt, t.spec_index, t.key, t.rule))


def remove_incomplete(save_dir: str) -> None:
    """Delete leftovers of a crashed save (rank 0, before training)."""
    if not os.path.isdir(save_dir):
        return
    for name in os.listdir(save_dir):
        if name.startswith(".incomplete."):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
