"""Read a ZeRO-3 checkpoint (DeepSpeed's plain engine, P = 1) as full tensors, one at a time.

ZeRO-3 keeps its own file layout, per tensor rank r (`mp_rank_RR`) and data-parallel rank d:

  zero_pp_rank_D_mp_rank_RR_model_states.pt   engine state and `param_shapes`: per optimizer group, each
                                              parameter's name and (tensor-rank) shape, in partition order
  zero_pp_rank_D_mp_rank_RR_optim_states.pt   `fp32_flat_groups`: this rank's fp32 master partition of
                                              each sub-group; `optimizer_state_dict`: the base optimizer's
                                              state of each sub-group's flat partition (state k is flat k)

A parameter of n elements is cut into DP partitions of ceil(n / DP) elements (the last one zero-padded);
rank d's partitions of every parameter of a sub-group are laid end to end in that sub-group's flat
tensor, in `param_shapes` order, sub-groups following each other (as DeepSpeed's `zero_to_fp32.py`
reads them). Joining rank 0..DP-1's partitions and dropping the padding gives the parameter.
"""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import torch

from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.checkpoint.universal import names
from megatron_ds.training.checkpoint.universal.deepspeed_source import FP32, DeepSpeedSource, _int
from megatron_ds.training.checkpoint.universal.state_files import load_file, materialize, narrow


class Position(NamedTuple):
    """Where one parameter's partition sits in every data-parallel rank's files."""

    sub_group: int
    offset: int
    """First element of the partition in the sub-group's flat tensor."""
    numel: int
    """Elements per partition: ceil(n / DP)."""
    shape: tuple[int, ...]


class Zero3Source(DeepSpeedSource):
    """`DeepSpeedSource` for ZeRO-3's partitioned files."""

    def model_states_file(self, stage: int, tp: int, dp: int = 0) -> str:
        return self._path(f"zero_pp_rank_{dp}_mp_rank_{self._mp(stage, tp):02d}_model_states.pt")

    def _first_optimizer_state(self) -> dict[str, Any]:
        return load_file(self.optim_file(0, 0, 0))["optimizer_state_dict"]["optimizer_state_dict"]

    def step(self, tensor: names.ModelTensor) -> int | None:
        _, module_name = names.source_stage(self.model, self.layout, tensor)
        sub_group = self._positions(0)[module_name].sub_group
        return self._steps(self.optim_file(0, 0, 0))[sub_group]

    def _steps(self, path: str) -> list[int | None]:
        """Each sub-group's step count (small metadata, read once per file)."""
        key = path + "#steps"
        if key not in self._meta_cache:
            state = self.files.open(path)["optimizer_state_dict"]["optimizer_state_dict"]["state"]
            steps = [materialize(state.get(k, {}).get("step"), path) for k in range(len(self._sizes(path)))]
            self._meta_cache[key] = [_int(step) for step in steps]
        return self._meta_cache[key]

    def _local(
        self, stage: int, tp: int, module_name: str, group: str, state: str, shape: tuple[int, ...]
    ) -> torch.Tensor:
        del stage, group
        position = self._positions(tp).get(module_name)
        numel = math.prod(shape)
        if position is None or position.shape != tuple(shape):
            raise CheckpointError(
                f"{self.model_states_file(0, tp)}: no parameter {module_name} of shape {list(shape)} in its "
                f"param_shapes; the checkpoint is damaged or of another model"
            )
        parts = [self._partition(tp, dp, position, state) for dp in range(self.data_parallel)]
        return torch.cat(parts)[:numel].view(shape)

    def _partition(self, tp: int, dp: int, position: Position, state: str) -> torch.Tensor:
        path = self.optim_file(0, tp, dp)
        osd = self.files.open(path)["optimizer_state_dict"]
        try:
            if state == FP32:
                flat = osd["fp32_flat_groups"][position.sub_group]
            else:
                flat = osd["optimizer_state_dict"]["state"][position.sub_group][state]
            return narrow(flat, position.offset, position.numel, path)
        except (KeyError, IndexError, RuntimeError) as err:
            raise CheckpointError(f"{path}: no {state} at {position} ({err}); the checkpoint is damaged") from None

    def _sizes(self, path: str) -> list[int]:
        """Each sub-group's flat partition size in one optimizer file."""
        key = path + "#sizes"
        if key not in self._meta_cache:
            self._meta_cache[key] = [
                int(t.numel()) for t in self.files.open(path)["optimizer_state_dict"]["fp32_flat_groups"]
            ]
        return self._meta_cache[key]

    def _positions(self, tp: int) -> dict[str, Position]:
        """Every parameter's position for tensor rank `tp`, from `param_shapes` and the sub-group sizes."""
        key = f"#positions{tp}"
        if key in self._meta_cache:
            return self._meta_cache[key]
        states_path = self.model_states_file(0, tp)
        shapes = [
            (name, tuple(shape)) for group in load_file(states_path)["param_shapes"] for name, shape in group.items()
        ]
        sizes = self._sizes(self.optim_file(0, tp, 0))
        positions, sub_group, offset = {}, 0, 0
        for name, shape in shapes:
            numel = -(-math.prod(shape) // self.data_parallel)
            while sub_group < len(sizes) and offset + numel > sizes[sub_group]:
                if offset != sizes[sub_group]:
                    raise CheckpointError(
                        f"{states_path}: {name} does not fit its sub-group; the checkpoint is damaged"
                    )
                sub_group, offset = sub_group + 1, 0
            if sub_group == len(sizes):
                raise CheckpointError(f"{states_path}: more parameters than partitions; the checkpoint is damaged")
            positions[name] = Position(sub_group, offset, numel, shape)
            offset += numel
        self._meta_cache[key] = positions
        return positions


def open_source(path_or_ckpt: Any) -> DeepSpeedSource:
    """The reader of one of our DeepSpeed checkpoints: a mixture-of-experts model's MoE files (the plain engine's at
    P = 1, the pipeline engine's per-stage ones at P > 1), ZeRO-3's partitioned files or the flat/torch ones."""
    from megatron_ds.training.checkpoint import reader

    if isinstance(path_or_ckpt, (str, os.PathLike)):
        ckpt = reader.open_checkpoint(path_or_ckpt, moe=True)
    else:
        ckpt = path_or_ckpt
    if ckpt.config.model.is_moe and ckpt.config.parallel.pipeline_model_parallel_size > 1:
        from megatron_ds.training.checkpoint.universal.moe_pipeline_source import MoePipelineSource

        return MoePipelineSource(ckpt)
    if ckpt.config.model.is_moe:
        from megatron_ds.training.checkpoint.universal.moe_source import MoeSource

        return MoeSource(ckpt)
    if ckpt.config.training.zero_stage == 3:
        return Zero3Source(ckpt)
    return DeepSpeedSource(ckpt)
