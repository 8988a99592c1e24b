"""Read a checkpoint `save_load.save` wrote through DeepSpeed as full (T=1) tensors, one at a time.

Where each part of the training state is, per (stage s, tensor rank r, data-parallel rank d), with
mp = s x T + r (DeepSpeed's model-parallel rank: tensor innermost):

  weights          layer_XX-model_RR-model_states.pt, one per spec and tensor rank (`checkpoint.reader`)
  ZeRO-0, fp32     mp_rank_MM_model_states.pt "optimizer": a torch optimizer state dict, its
                   per-parameter state numbered group by group (`names.optimizer_order`)
  ZeRO-1, or bf16  [bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt: this rank's flat fp32 partition of
  (any ZeRO)       each group (the fp32 master weights), the base optimizer's state of that flat
                   partition, and `param_slice_mappings`: each parameter's fragment (start, numel) in
                   it. A parameter's fragments over D, in D order, are the parameter (DeepSpeed's own
                   `ds_to_universal` joins them the same way).
  engine state     mp_rank_00_model_states.pt: global_steps, global_samples, skipped_steps, lr_scheduler

Files are read with `torch.load(weights_only=True)` (DeepSpeed's few classes in them are allow-listed, no
other code runs): memory-mapped and reopened per tensor (the weights' layer files), or, for the optimizer files, unpickled once
with their tensors read from disk one by one (`state_files`); either way only the bytes of one tensor are resident
at a time. fp16 without ZeRO (DeepSpeed's FP16_Optimizer) is not read.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megatron_ds.model import naming, sharding
from megatron_ds.pipeline.layout import Layout, build_layout
from megatron_ds.training.checkpoint import reader
from megatron_ds.training.checkpoint.directory import META, CheckpointError, fingerprint
from megatron_ds.training.checkpoint.universal import names
from megatron_ds.training.checkpoint.universal.state_files import StateFiles, load_file, materialize, narrow
from megatron_ds.training.optimizer import GROUP_NAMES

FP32 = "fp32"
"""The state name of the fp32 master weights (as in DeepSpeed's universal checkpoints)."""


def local_shape(rule: sharding.TensorRule, tensor_parallel: int) -> tuple[int, ...]:
    """The shape of one tensor rank's shard."""
    shape = list(rule.shape)
    if tensor_parallel > 1 and rule.split in (sharding.ROWS, sharding.FUSED_ROWS):
        shape[0] //= tensor_parallel
    elif tensor_parallel > 1 and rule.split == sharding.COLUMNS:
        shape[1] //= tensor_parallel
    return tuple(shape)


class DeepSpeedSource:
    """The training state of one DeepSpeed checkpoint, tensor by tensor."""

    def __init__(self, ckpt: reader.Checkpoint) -> None:
        self.ckpt = ckpt
        cfg = ckpt.config
        self.model = cfg.model
        self.tensor_parallel = cfg.parallel.tensor_model_parallel_size
        # ZeRO's partitions: over DP x N ranks under Ulysses (DeepSpeed's sequence-data-parallel group)
        self.data_parallel = cfg.parallel.data_parallel_size * cfg.parallel.ds_sequence_parallel_size
        self.precision = cfg.training.precision
        self.unfused = self.precision == "bf16" and cfg.training.zero_stage == 0 and cfg.engine_kind == "plain"
        """bf16 without ZeRO on the plain engine (--kd, Ulysses): DeepSpeed's FP16_UnfusedOptimizer in the model-states
        file, its `fp32_groups` the masters, the torch optimizer's state over them by position."""
        self.flat = cfg.training.zero_stage >= 1 or (self.precision == "bf16" and not self.unfused)
        if self.precision == "fp16" and not self.flat:
            raise CheckpointError(
                f"{ckpt.directory}: an --fp16 checkpoint without ZeRO (DeepSpeed's FP16_Optimizer) cannot be "
                f"converted; resume it with its own layout, or load weights only with --no-load-optim"
            )
        groups = naming.gpt_spec_groups(self.model)
        p = cfg.parallel.pipeline_model_parallel_size
        try:
            v = cfg.parallel.virtual_stages
            self.layout: Layout = build_layout(groups, p, layout=ckpt.meta["layout"], virtual_stages=v)
        except (KeyError, ValueError) as err:
            raise CheckpointError(
                f"{ckpt.directory}: no usable layout in its metadata ({err}); it is damaged"
            ) from None
        self._mp_world = p * self.tensor_parallel
        self._meta_cache: dict[str, Any] = {}  # per file: parameter positions and step counts (no tensors)
        self.files = StateFiles()  # the optimizer files, each unpickled once

    def _path(self, name: str) -> str:
        return os.path.join(self.ckpt.directory, name)

    def _mp(self, stage: int, tp: int) -> int:
        return stage * self.tensor_parallel + tp if self._mp_world > 1 else 0

    def model_states_file(self, stage: int, tp: int) -> str:
        return self._path(f"mp_rank_{self._mp(stage, tp):02d}_model_states.pt")

    def optim_file(self, stage: int, tp: int, dp: int) -> str:
        prefix = "bf16_" if self.precision == "bf16" else ""
        return self._path(f"{prefix}zero_pp_rank_{dp}_mp_rank_{self._mp(stage, tp):02d}_optim_states.pt")

    def engine_state(self) -> dict[str, Any]:
        """DeepSpeed's step counters and the learning-rate scheduler's state (the first stage's)."""
        sd = load_file(self.model_states_file(0, 0))
        keys = ("global_steps", "global_samples", "skipped_steps")
        return {**{k: int(sd.get(k) or 0) for k in keys}, "lr_scheduler": sd.get("lr_scheduler")}

    def _first_optimizer_state(self) -> dict[str, Any]:
        if self.flat:
            return self.files.open(self.optim_file(0, 0, 0))["optimizer_state_dict"]["base_optimizer_state"]
        return self._torch_optimizer(self.model_states_file(0, 0))

    def _torch_optimizer(self, path: str) -> dict[str, Any]:
        """The torch optimizer's state dict in a model-states file (inside FP16_UnfusedOptimizer's under bf16)."""
        saved = self.files.open(path)["optimizer"] or {}  # its tensors on the meta device: `materialize` them
        return saved.get("optimizer_state_dict", {}) if self.unfused else saved

    def state_keys(self) -> list[str]:
        """The per-parameter tensor states the optimizer keeps (Adam: exp_avg, exp_avg_sq); [] before its first step."""
        state = self._first_optimizer_state().get("state", {})
        if not state:
            return []
        first = state[min(state)]
        return [k for k, v in first.items() if isinstance(v, torch.Tensor) and v.ndim >= 1]

    def record(self) -> dict[str, Any]:
        """What the universal form records of its source (the fingerprint names the exact checkpoint)."""
        cfg = self.ckpt.config
        return {
            "directory": self.ckpt.directory,
            "fingerprint": fingerprint(os.path.join(self.ckpt.directory, META)),
            "layout": self.layout.to_string(),
            "pipeline_model_parallel_size": cfg.parallel.pipeline_model_parallel_size,
            "tensor_model_parallel_size": cfg.parallel.tensor_model_parallel_size,
            "data_parallel_size": cfg.parallel.data_parallel_size,
            "ds_sequence_parallel_size": cfg.parallel.ds_sequence_parallel_size,
            "zero_stage": cfg.training.zero_stage,
            "precision": cfg.training.precision,
        }

    def loss_scaler(self) -> dict[str, Any] | None:
        """The fp16 loss scaler's numbers (ZeRO and bf16 optimizers keep one; only fp16 uses it)."""
        if not self.flat:
            return None
        scaler = self.files.open(self.optim_file(0, 0, 0))["optimizer_state_dict"].get("loss_scaler")
        if scaler is None:
            return None
        return {k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float))}

    def read(self, tensor: names.ModelTensor, state: str) -> torch.Tensor:
        """`state` (FP32 or an optimizer state) of `tensor` as its full T=1 tensor."""
        stage, module_name = names.source_stage(self.model, self.layout, tensor)
        if state == FP32 and not self.flat and not self.unfused:  # fp32 without ZeRO: the weights are the masters
            return reader.read_spec_tensor(self.ckpt, tensor.spec_index, tensor.key, tensor.rule)
        shape = local_shape(tensor.rule, self.tensor_parallel)
        shards = [self._local(stage, tp, module_name, tensor.group, state, shape) for tp in range(self.tensor_parallel)]
        full = sharding.gather(tensor.rule, shards)
        assert tuple(full.shape) == tensor.rule.shape, (tensor.name, tuple(full.shape))
        return full

    def step(self, tensor: names.ModelTensor) -> int | None:
        """The optimizer's step count for `tensor` (None before the first step)."""
        stage, module_name = names.source_stage(self.model, self.layout, tensor)
        if self.flat:
            return self._steps(self.optim_file(stage, 0, 0))[GROUP_NAMES.index(tensor.group)]
        path = self.model_states_file(stage, 0)
        return self._torch_steps(stage, path)[self._torch_index(stage, path)[module_name]]

    def _local(
        self, stage: int, tp: int, module_name: str, group: str, state: str, shape: tuple[int, ...]
    ) -> torch.Tensor:
        numel = int(torch.Size(shape).numel())
        if not self.flat:
            path = self.model_states_file(stage, tp)
            index = self._torch_index(stage, path)[module_name]
            if state == FP32:  # FP16_UnfusedOptimizer's fp32 copy of the parameter at `index`
                groups = self._torch_optimizer(path).get("param_groups", [])
                g = next((g for g, group in enumerate(groups) if index in group["params"]), None)
                fp32 = self.files.open(path)["optimizer"].get("fp32_groups") or []
                value = None if g is None else fp32[g][groups[g]["params"].index(index)]
            else:
                value = self._torch_optimizer(path)["state"].get(index, {}).get(state)
            if not isinstance(value, torch.Tensor) or value.numel() != numel:
                raise CheckpointError(
                    f"{path}: no {state} of shape {list(shape)} for {module_name}; the checkpoint is damaged"
                )
            return materialize(value, path).reshape(shape)
        pieces = [self._fragment(stage, tp, dp, module_name, group, state) for dp in range(self.data_parallel)]
        pieces = [p for p in pieces if p is not None]
        joined = None if not pieces else pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # one copy at most
        if joined is None or joined.numel() != numel:
            got = 0 if joined is None else joined.numel()
            raise CheckpointError(
                f"{self.optim_file(stage, tp, 0)}: {module_name} has {got} of its {numel} elements over "
                f"{self.data_parallel} data-parallel partition(s); the checkpoint is incomplete or damaged"
            )
        return joined.view(shape)

    def _fragment(self, stage: int, tp: int, dp: int, module_name: str, group: str, state: str) -> torch.Tensor | None:
        path = self.optim_file(stage, tp, dp)
        osd = self.files.open(path)["optimizer_state_dict"]
        return held_fragment(osd, GROUP_NAMES.index(group), state, path, module_name)

    def _steps(self, path: str) -> list[int | None]:
        """Each group's step count in a flat optimizer file (small metadata, read once per file)."""
        if path not in self._meta_cache:
            state = self.files.open(path)["optimizer_state_dict"]["base_optimizer_state"]["state"]
            steps = [materialize(state.get(g, {}).get("step"), path) for g in range(len(GROUP_NAMES))]
            self._meta_cache[path] = [_int(step) for step in steps]
        return self._meta_cache[path]

    def _torch_steps(self, stage: int, path: str) -> dict[int, int | None]:
        key = path + "#steps"
        if key not in self._meta_cache:
            state = self._torch_optimizer(path)["state"]
            self._meta_cache[key] = {i: _int(materialize(entry.get("step"), path)) for i, entry in state.items()}
        return self._meta_cache[key]

    def _torch_index(self, stage: int, path: str) -> dict[str, int]:
        """Each parameter's position in the stage's torch optimizer (its state-dict key), checked once per file."""
        if path in self._meta_cache:
            return self._meta_cache[path]
        params = names.stage_parameters(self.model, self.layout, stage)
        saved = self._torch_optimizer(path)
        counts = [len(g["params"]) for g in saved.get("param_groups", [])]
        expected = [sum(1 for p in params if p.group == g) for g in GROUP_NAMES]
        if counts != expected:
            raise CheckpointError(
                f"{path}: optimizer groups hold {counts} parameters, this model's stage {stage} holds {expected}; "
                f"the checkpoint was written by another model or version"
            )
        self._meta_cache[path] = {p.module_name: i for i, p in enumerate(names.optimizer_order(params))}
        return self._meta_cache[path]


def partition_fragment(
    osd: dict[str, Any], group: int, fragment: Any, state: str, path: str, name: str
) -> torch.Tensor:
    """`state` (FP32: the fp32 master) of one parameter's `fragment` (DeepSpeed's `param_slice_mappings` entry) of
    group `group` in a ZeRO-1/2 or bf16 flat partition file's `optimizer_state_dict`, as a tensor of its own; a
    CheckpointError naming `path` and `name` when it is not there."""
    try:
        if state == FP32:
            flat = osd["single_partition_of_fp32_groups"][group]
        else:
            flat = osd["base_optimizer_state"]["state"][group][state]
        return narrow(flat, fragment.start, fragment.numel, path)
    except (KeyError, IndexError, RuntimeError) as err:
        raise CheckpointError(f"{path}: no {state} for {name} ({err}); the checkpoint is damaged") from None


def held_fragment(osd: dict[str, Any], group: int, state: str, path: str, name: str) -> torch.Tensor | None:
    """`partition_fragment` of parameter `name` where this partition file maps it (`param_slice_mappings`), None
    where the partition holds none of it; a CheckpointError naming `path` and `name` when the map is missing."""
    try:
        fragment = osd["param_slice_mappings"][group].get(name)
    except (KeyError, IndexError, AttributeError) as err:
        raise CheckpointError(f"{path}: no {state} for {name} ({err}); the checkpoint is damaged") from None
    return None if fragment is None else partition_fragment(osd, group, fragment, state, path, name)


def _int(step: Any) -> int | None:
    return None if step is None else int(float(step))
