"""Before DeepSpeed's loader opens a checkpoint as saved: each rank's files there and whole, agreed on all ranks.

DeepSpeed's loader `torch.load`s with `weights_only=False` and, on a missing or damaged file, fails on one rank with a
traceback while the others wait at their next collective. Here every file a rank is about to load (its weights, its
engine state, its ZeRO partition, its RNG state, its experts') is checked first, tensors read with `weights_only`,
and a problem is the same one-line CheckpointError on every rank (`rank_agreement.fail_together`).
"""

from __future__ import annotations

import os
import zipfile
from typing import Any

from megatron_ds.config import Config
from megatron_ds.training.checkpoint import experts, reader
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.rank_agreement import fail_together


def check_rank_files(engine: Any, config: Config, load_dir: str, tag: str, weights_only: bool = False) -> None:
    """Before DeepSpeed loads the checkpoint as saved: every file of each rank's (its weights, its engine state, its
    ZeRO partition, its RNG state) is there and whole (its experts' files, tensors only, read memory-mapped), agreed
    on all ranks (`fail_together`), so a missing or damaged file is the same one-line CheckpointError everywhere
    instead of one rank's traceback from DeepSpeed's loader and the others waiting at their next collective. A
    missing RNG state is an error unless --no-load-rng, as Megatron's."""
    with fail_together():
        problems = _rank_file_problems(engine, config, load_dir, tag, weights_only)
        if problems:
            raise CheckpointError(problems[0])


def _rank_file_problems(engine: Any, config: Config, load_dir: str, tag: str, weights_only: bool) -> list[str]:
    """What is wrong with this rank's files of `tag` (`check_rank_files`), each as one line."""
    import torch.distributed as dist

    from megatron_ds.training.checkpoint.universal.state_files import load_file

    directory = os.path.join(load_dir, tag)
    problems = []
    try:
        check_layer_files(engine, directory)
    except CheckpointError as err:
        problems.append(str(err))
    wanted = [engine._get_ckpt_name(load_dir, tag)]  # DeepSpeed's own names for this rank's files
    if engine.zero_optimization():
        wanted.append(engine._get_zero_ckpt_name(load_dir, tag))
    expert_files = _expert_files(engine, load_dir, tag, weights_only)
    wanted += expert_files
    if getattr(engine.module, "moe_layers", None) and not os.path.isfile(os.path.join(directory, experts.EXPERTS_FILE)):
        problems.append(
            f"{directory}: a mixture-of-experts checkpoint without {experts.EXPERTS_FILE}, saved before megatron_ds gave "
            f"each expert the fc2 bias Megatron-DeepSpeed's experts have: its experts do not fit this model; load it "
            f"with the megatron_ds release that wrote it"
        )
    rng = os.path.join(directory, f"rng_rank{dist.get_rank()}.pt")
    no_rng = config.checkpoint.no_load_rng or weights_only
    for path in [*wanted, *([rng] if not no_rng else [])]:
        if not os.path.isfile(path):
            fix = (
                "give --no-load-rng to start the RNG from --seed, as Megatron says"
                if path == rng
                else "the checkpoint is incomplete: resume from another one (--load-tag), or --no-load-optim for its weights"
            )
            problems.append(f"{path}: missing; {fix}")
        elif not zipfile.is_zipfile(path):
            problems.append(
                f"{path}: cut short or damaged (not a whole torch file); resume from another checkpoint (--load-tag)"
            )
        elif path in expert_files:  # an expert's weights alone: tensors, read as DeepSpeed's loader will
            try:
                load_file(path)
            except CheckpointError as err:
                problems.append(f"{err}; resume from another checkpoint (--load-tag)")
    return problems


def _expert_files(engine: Any, load_dir: str, tag: str, weights_only: bool) -> list[str]:
    """A mixture-of-experts model's files this rank loads: its experts' (DeepSpeed numbers the MoE layers from 0 and
    the experts globally) and, for a full resume without ZeRO, its expert-parallel rank's optimizer state (under ZeRO
    1/2 the optimizer state is in the ZeRO partition files, experts included)."""
    from megatron_ds.model.moe import expert_parallel_rank, local_expert_ids

    layers = getattr(engine.module, "moe_layers", None) or []  # at P > 1: this stage's, under its model-parallel rank
    paths = [
        engine._get_expert_ckpt_name(load_dir, layer_id, expert, tag, mpu=engine.mpu)
        for layer_id, layer in enumerate(layers)
        for expert in local_expert_ids(layer.moe)
    ]
    if layers and not weights_only and not engine.zero_optimization():
        paths.append(engine._get_optimizer_ckpt_name(load_dir, tag, expert_parallel_rank(layers[0].moe)))
    return paths


def check_layer_files(engine: Any, directory: str) -> None:
    """The per-spec weight files this rank is about to load, each read tensors-only first (memory-mapped): a
    missing or damaged file is a one-line CheckpointError naming it instead of a traceback from DeepSpeed's loader,
    and one that holds pickled code is refused before that loader (`torch.load(weights_only=False)`) opens it."""
    module = engine.module
    if getattr(module, "moe_layers", None):  # mixture of experts: DeepSpeed's own files (`check_rank_files`)
        return
    if hasattr(module, "spec_modules"):  # our GPTModel (the plain engine)
        paths = [module.layer_file(directory, index) for index in module.spec_modules]
    else:  # DeepSpeed's PipelineModule: the layers with weights of this stage, this tensor rank's files
        paths = [
            module.ckpt_layer_path(directory, i)
            for i, layer in enumerate(module.forward_funcs)
            if hasattr(layer, "load_state_dict")
        ]
    for path in paths:
        reader.load_state(path)
