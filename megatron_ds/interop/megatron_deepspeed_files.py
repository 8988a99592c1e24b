"""The files of a Megatron-DeepSpeed (GPTModelPipe) checkpoint, read without running code from them.

    ROOT/latest                                   DeepSpeed's tag (`global_stepN`)
    ROOT/latest_checkpointed_iteration.txt        Megatron's tracker (N)
    ROOT/global_stepN/layer_XX-model_RR-model_states.pt   spec XX's weights on tensor rank RR
    ROOT/global_stepN/mp_rank_MM_model_states.pt  per stage and tensor rank (MM = stage x T + rank):
        DeepSpeed's engine state (step counters, `lr_scheduler`: Megatron's OptimizerParamScheduler,
        `optimizer`: the torch optimizer state without ZeRO), and Megatron's `args` (the Namespace
        of the run), `iteration`, `tokens`, `rng_state`, `universal_checkpoint_info`
    ROOT/global_stepN/[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt   ZeRO-1/2 or bf16: flat
        fp32 partitions with `param_slice_mappings` (read by `deepspeed_source.load_file`)

Layer files hold tensors only: `torch.load(weights_only=True)`. The `mp_rank` files hold pickled
objects as well; they go through `restricted_pickle.upstream_values`, which builds the types such a
file is expected to hold (argparse.Namespace, containers, tensors and storages, torch dtypes) and
keeps upstream's own values (Megatron's enums, numpy RNG states) as inert records; any other global
is refused. Nothing of Megatron-DeepSpeed is imported or run.
"""

from __future__ import annotations

import argparse
import glob
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from megatron_ds import files
from megatron_ds.interop import restricted_pickle
from megatron_ds.interop.saved_flags import SavedArgs, check_saved_args
from megatron_ds.training.checkpoint.directory import LATEST, MEGATRON_TRACKER, CheckpointError

_TORCH_LOAD = restricted_pickle.pickle_module(restricted_pickle.upstream_values)
"""Storages through torch's persistent ids, every other global through `upstream_values`."""


def load_model_states(path: str) -> dict[str, Any]:
    """An `mp_rank_MM_model_states.pt` file: tensors memory-mapped, other globals restricted."""
    state = _load(
        path, lambda p: torch.load(p, map_location="cpu", weights_only=False, pickle_module=_TORCH_LOAD, mmap=True)
    )
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a dictionary of states; the checkpoint is damaged")
    return state


def load_layer(path: str) -> dict[str, Any]:
    """A `layer_XX-model_RR-model_states.pt` file (tensors only)."""
    return _load(path, lambda p: torch.load(p, map_location="cpu", weights_only=True, mmap=True))


def _load(path: str, load: Any) -> Any:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete")
    try:
        return load(path)
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError, AttributeError) as err:
        raise CheckpointError(
            files.load_failure(path, err, "the checkpoint is damaged or not Megatron-DeepSpeed's")
        ) from None


@dataclass(frozen=True)
class MegatronDeepSpeedCheckpoint(SavedArgs):
    """One global_step directory of a Megatron-DeepSpeed checkpoint and the run's saved arguments."""

    directory: str
    tag: str
    args: dict[str, Any]
    """`vars()` of the saved Namespace (upstream's enums as `restricted_pickle.Inert` records)."""
    states: dict[str, Any]
    """mp_rank_00's entries other than the optimizer and `args`."""

    @property
    def no_pipeline(self) -> bool:
        """Saved with `--no-pipeline-parallel`: GPTModel on DeepSpeed's plain engine, no layer files."""
        return bool(self.args.get("no_pipeline_parallel"))

    @property
    def data_parallel(self) -> int:
        return int(self.args.get("data_parallel_size") or self.states.get("dp_world_size") or 1)

    @property
    def ds_config(self) -> dict[str, Any]:
        return self.args.get("deepspeed_config_dict") or self.states.get("ds_config") or {}

    @property
    def zero_stage(self) -> int:
        return int((self.ds_config.get("zero_optimization") or {}).get("stage", 0))

    @property
    def checkpoint_info(self) -> dict[str, Any]:
        return self.states.get("universal_checkpoint_info") or {}

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def model_parallel_rank(self, stage: int, tensor_rank: int) -> int:
        return stage * self.tensor_parallel + tensor_rank

    def model_states_file(self, stage: int, tensor_rank: int) -> str:
        return self.path(f"mp_rank_{self.model_parallel_rank(stage, tensor_rank):02d}_model_states.pt")

    def layer_file(self, spec_index: int, tensor_rank: int) -> str:
        return self.path(f"layer_{spec_index:02d}-model_{tensor_rank:02d}-model_states.pt")

    def optim_file(self, stage: int, tensor_rank: int, dp_rank: int) -> str:
        prefix = "bf16_" if self.precision == "bf16" else ""
        mp = self.model_parallel_rank(stage, tensor_rank)
        return self.path(f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_{mp:02d}_optim_states.pt")

    @property
    def flat_optimizer(self) -> bool:
        """DeepSpeed's ZeRO or bf16 optimizer: flat fp32 partitions in `*_optim_states.pt` files."""
        return self.zero_stage >= 1 or self.precision == "bf16"


FIRST_STATES = "mp_rank_00_model_states.pt"


def find_step_directory(path: str) -> tuple[str, str]:
    """(global_step directory, tag) from a checkpoint root (DeepSpeed's `latest`, else Megatron's
    tracker) or from a global_step directory itself."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory; give a Megatron-DeepSpeed checkpoint directory (--save)")
    if os.path.isfile(os.path.join(path, "mp_rank_00_model_states.pt")):
        return path, os.path.basename(path)
    tag = None
    if os.path.isfile(os.path.join(path, LATEST)):
        tag = open(os.path.join(path, LATEST)).read().strip()
    elif os.path.isfile(os.path.join(path, MEGATRON_TRACKER)):
        tag = "global_step" + open(os.path.join(path, MEGATRON_TRACKER)).read().strip()
    steps = sorted(os.path.basename(os.path.dirname(f)) for f in glob.glob(os.path.join(path, "*", FIRST_STATES)))
    if tag and steps and tag not in steps:  # the pointer names a step deleted, or a save that did not finish
        raise CheckpointError(
            f"{path}: its pointer names {tag!r}, which holds no {FIRST_STATES}; give one of its complete steps as "
            f"the source, e.g. {os.path.join(path, steps[-1])}"
        )
    if tag is None or not os.path.isfile(os.path.join(path, tag, "mp_rank_00_model_states.pt")):
        raise CheckpointError(
            f"{path}: not a Megatron-DeepSpeed checkpoint (no '{LATEST}' naming a global_step directory with "
            f"mp_rank_00_model_states.pt); give the directory its run passed as --save, or one of its global_step "
            f"directories"
        )
    return os.path.join(path, tag), tag


def open_megatron_deepspeed(path: str) -> MegatronDeepSpeedCheckpoint:
    directory, tag = find_step_directory(path)
    first = os.path.join(directory, "mp_rank_00_model_states.pt")
    states = load_model_states(first)
    args = states.get("args")
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(
            f"{first}: no saved 'args'; a DeepSpeed checkpoint, but not one Megatron-DeepSpeed's pretrain_gpt.py wrote"
        )
    kept = {k: v for k, v in states.items() if k not in ("args", "optimizer", "module")}
    ckpt = MegatronDeepSpeedCheckpoint(directory, tag, dict(vars(args)), kept)
    check_saved_args(ckpt.args, first)
    return ckpt
