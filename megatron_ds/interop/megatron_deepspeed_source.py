"""A Megatron-DeepSpeed checkpoint's training state as our full (T=1) tensors, one at a time.

The same reader interface as `training.checkpoint.universal.deepspeed_source.DeepSpeedSource` (what
`universal.store.write` takes), over upstream's files (`megatron_deepspeed_layout` says where each
tensor is): weights from the layer files; without ZeRO in fp32 the torch optimizer state of each
stage (`mp_rank_MM_model_states.pt`, numbered group by group); with ZeRO or bf16 the flat fp32
partitions (`*_optim_states.pt`, fragments found by name in `param_slice_mappings`), joined over
data-parallel ranks in rank order. Each tensor rank's shard is brought into our row order (fused
QKV, `QKV_LAYOUTS`) and the shards joined by our sharding rules.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megatron_ds.interop import megatron_deepspeed_layout as where
from megatron_ds.interop.megatron_deepspeed_files import MegatronDeepSpeedCheckpoint, load_layer, load_model_states
from megatron_ds.model import sharding
from megatron_ds.training.checkpoint import reader
from megatron_ds.training.checkpoint.directory import META, CheckpointError, fingerprint
from megatron_ds.training.checkpoint.universal.deepspeed_source import FP32, held_fragment, local_shape
from megatron_ds.training.checkpoint.universal.names import ModelTensor
from megatron_ds.training.checkpoint.universal.state_files import StateFiles, materialize

MEGATRON_GROUPS = ("wd_no_scale_lr", "no_wd_no_scale_lr")
"""Megatron's optimizer groups of a GPT (`get_param_groups`: weight decay, then none)."""


class MegatronDeepSpeedSource:
    """Reads `mds` for the converted checkpoint `ours` (its config and metadata, already written)."""

    def __init__(self, mds: MegatronDeepSpeedCheckpoint, ours: reader.Checkpoint, qkv_layout: str) -> None:
        self.mds, self.ckpt, self.qkv_layout = mds, ours, qkv_layout
        self.model = ours.config.model
        self.tensor_parallel = mds.tensor_parallel
        self.flat = mds.flat_optimizer
        if mds.precision == "fp16" and not self.flat:
            raise CheckpointError(
                f"{mds.directory}: an fp16 checkpoint without ZeRO (DeepSpeed's FP16_Optimizer) cannot be converted"
            )
        self.parts = where.stage_parts(self.model, mds.pipeline_parallel, mds.precision != "fp32")
        self._cache: dict[str, Any] = {}
        self._files = StateFiles()  # the flat optimizer files: unpickled once, tensors read one by one

    # ----- what store.write asks ------------------------------------------------------------------

    def state_keys(self) -> list[str]:
        """The optimizer's per-parameter tensor states ([] when none was saved or before a step)."""
        state = self._optimizer(0, 0, 0).get("state", {}) if self._has_optimizer() else {}
        if not state:
            return []
        first = state[min(state)]
        return [k for k, v in first.items() if isinstance(v, torch.Tensor) and v.ndim >= 1]

    def step(self, tensor: ModelTensor) -> int | None:
        stage, p = self._where(tensor)
        state = self._optimizer(stage, 0, 0)["state"]
        index = p.group if self.flat else self._index(stage)[p.module_name]
        step = state.get(index, {}).get("step")
        if self.flat:  # a tensor in the file, not yet read
            step = materialize(step, self.mds.optim_file(stage, 0, 0))
        return None if step is None else int(float(step))

    def read(self, tensor: ModelTensor, state: str) -> torch.Tensor:
        """`state` (FP32: the weight, or with ZeRO/bf16 the fp32 master) as our full fp32 tensor."""
        stage, p = self._where(tensor)
        shape = local_shape(tensor.rule, self.tensor_parallel)
        shards = [self._shard(stage, tp, p, state, shape) for tp in range(self.tensor_parallel)]
        return self._join(tensor, p, shards).float()

    def weight(self, tensor: ModelTensor) -> torch.Tensor:
        """The model's weight as the layer files store it (in its dtype), as our full tensor."""
        _, p = self._where(tensor)
        return self._join(tensor, p, [self._weight(p, tp) for tp in range(self.tensor_parallel)])

    def _join(self, tensor: ModelTensor, p: where.Place, shards: list[torch.Tensor]) -> torch.Tensor:
        """Our full tensor from upstream's tensor-rank shards (QKV rows in our order first)."""
        if tensor.key in ("qkv.weight", "qkv.bias") and self.qkv_layout == where.INTERLEAVED:
            shards = [where.qkv_to_blocked(s, self.model, self.tensor_parallel) for s in shards]
        if tensor.rule.split == sharding.REPLICATED and sharding.replicas_differ(shards):
            raise CheckpointError(f"{self._file(p, 0)}: {p.key} differs between tensor-parallel ranks; it is damaged")
        full = sharding.gather(tensor.rule, shards).contiguous()
        if tuple(full.shape) != tensor.rule.shape:
            raise CheckpointError(
                f"{self._file(p, 0)}: {p.key} joins to shape {list(full.shape)}, its saved args "
                f"imply {list(tensor.rule.shape)}; the checkpoint is damaged"
            )
        return full

    def engine_state(self) -> dict[str, Any]:
        from megatron_ds.interop.megatron_deepspeed_args import lr_schedule_state

        s = self.mds.states
        counters = {k: int(s.get(k) or 0) for k in ("global_steps", "global_samples", "skipped_steps")}
        return {**counters, "lr_scheduler": lr_schedule_state(self.mds, self.ckpt.config)}

    def loss_scaler(self) -> dict[str, Any] | None:
        if not self.flat or not self._has_optimizer():
            return None
        scaler = self._optim_states(0, 0, 0).get("loss_scaler")
        return None if scaler is None else {k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float))}

    def record(self) -> dict[str, Any]:
        m = self.mds
        return {
            "format": "megatron-deepspeed",
            "directory": m.directory,
            "fingerprint": fingerprint(os.path.join(self.ckpt.directory, META)),
            "pipeline_model_parallel_size": m.pipeline_parallel,
            "no_pipeline_parallel": m.no_pipeline,
            "tensor_model_parallel_size": m.tensor_parallel,
            "data_parallel_size": m.data_parallel,
            "zero_stage": m.zero_stage,
            "precision": m.precision,
            "qkv_layout": self.qkv_layout,
            "stage_parts": self.parts,
        }

    # ----- upstream's files ---------------------------------------------------------------------

    def _where(self, tensor: ModelTensor) -> tuple[int, where.Place]:
        p = where.place(self.model, tensor, self.mds.no_pipeline)
        return (0 if self.mds.no_pipeline else where.stage_of(self.parts, p.spec_index)), p

    def stage_parameters(self, stage: int) -> list[tuple[str, ModelTensor]]:
        return where.stage_parameters(self.model, self.parts, stage, self.mds.no_pipeline)

    def _file(self, p: where.Place, tp: int) -> str:
        """The file holding `p`'s weight on tensor rank `tp`."""
        if p.spec_index == where.NO_PIPELINE_SPEC:
            return self.mds.model_states_file(0, tp)
        return self.mds.layer_file(p.spec_index, tp)

    def _module(self, tp: int) -> dict[str, Any]:
        """A `--no-pipeline-parallel` run's weights on tensor rank `tp`, by dotted name."""
        key = f"module{tp}"
        if key not in self._cache:
            self._cache[key] = _flatten(self._model_states(0, tp).get("module") or {})
        return self._cache[key]

    def _has_optimizer(self) -> bool:
        if self.flat:
            return os.path.isfile(self.mds.optim_file(0, 0, 0))
        return bool(self._model_states(0, 0).get("optimizer"))

    def _model_states(self, stage: int, tp: int) -> dict[str, Any]:
        path = self.mds.model_states_file(stage, tp)
        if path not in self._cache:  # small without ZeRO too: tensors are memory-mapped
            self._cache[path] = load_model_states(path)
        return self._cache[path]

    def _optimizer(self, stage: int, tp: int, dp: int) -> dict[str, Any]:
        """The torch optimizer state (`state`, `param_groups`), or the flat optimizer's base state."""
        if self.flat:
            return self._optim_states(stage, tp, dp)["base_optimizer_state"]
        return self._model_states(stage, tp)["optimizer"]

    def _optim_states(self, stage: int, tp: int, dp: int) -> dict[str, Any]:
        """The `optimizer_state_dict` of one flat optimizer file, unpickled once with its tensors unread
        (`state_files`): every tensor's fragments, step and the split check read it."""
        return self._files.open(self.mds.optim_file(stage, tp, dp))["optimizer_state_dict"]

    def _index(self, stage: int) -> dict[str, int]:
        key = f"index{stage}"
        if key not in self._cache:
            index = where.optimizer_index(self.model, self.parts, stage, self.mds.no_pipeline)
            groups = self._optimizer(stage, 0, 0).get("param_groups", [])
            counts = [len(g["params"]) for g in groups]
            expected = [sum(1 for n, t in self.stage_parameters(stage) if _group(t) == g) for g in (0, 1)]
            names = [g.get("name") for g in groups]
            if counts != expected or any(n not in (None, *MEGATRON_GROUPS) for n in names):
                raise CheckpointError(
                    f"{self.mds.model_states_file(stage, 0)}: the optimizer's groups {names} hold {counts} parameters, "
                    f"GPTModelPipe's stage {stage} (DeepSpeed's type:transformer split) holds {expected}; it was written "
                    f"by another model or split"
                )
            self._cache[key] = index
        return self._cache[key]

    def _shard(self, stage: int, tp: int, p: where.Place, state: str, shape: tuple[int, ...]) -> torch.Tensor:
        if state == FP32 and not (self.flat and self._has_optimizer()):  # else the fp32 master in the partition
            return self._weight(p, tp)
        if not self.flat:
            value = self._optimizer(stage, tp, 0)["state"].get(self._index(stage)[p.module_name], {}).get(state)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                raise CheckpointError(
                    f"{self.mds.model_states_file(stage, tp)}: no {state} of shape {list(shape)} for {p.module_name}; "
                    f"the checkpoint is damaged or of another split"
                )
            return value.detach().clone()
        pieces = [self._fragment(stage, tp, dp, p, state) for dp in range(self.mds.data_parallel)]
        pieces = [x for x in pieces if x is not None]
        numel = int(torch.Size(shape).numel())
        if sum(x.numel() for x in pieces) != numel:
            raise CheckpointError(
                f"{self.mds.optim_file(stage, tp, 0)}: {p.module_name} has {sum(x.numel() for x in pieces)} of its "
                f"{numel} elements over {self.mds.data_parallel} data-parallel partition(s); the checkpoint is incomplete"
            )
        return torch.cat(pieces).view(shape)

    def _weight(self, p: where.Place, tp: int) -> torch.Tensor:
        path = self._file(p, tp)
        value = (self._module(tp) if p.spec_index == where.NO_PIPELINE_SPEC else load_layer(path)).get(p.key)
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path}: no tensor {p.key!r}; the checkpoint is damaged or of another model")
        return value.detach().clone()

    def _fragment(self, stage: int, tp: int, dp: int, p: where.Place, state: str) -> torch.Tensor | None:
        osd = self._optim_states(stage, tp, dp)
        return held_fragment(osd, p.group, state, self.mds.optim_file(stage, tp, dp), p.module_name)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": x}} -> {"a.b": x} (GPTModel's state_dict_for_save_checkpoint nests its sub-modules)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _group(tensor: ModelTensor) -> int:
    return 0 if len(tensor.rule.shape) >= 2 else 1


def check_split(source: MegatronDeepSpeedSource) -> None:
    """Every stage's parameters are where DeepSpeed's split puts them (checked against the files)."""
    for stage in range(source.mds.pipeline_parallel):
        if source.flat and source._has_optimizer():
            # ZeRO partitions each group over the data-parallel ranks: a rank maps only the tensors (or parts of
            # tensors) in its partition, so the stage's tensors are the union over the ranks.
            found = sorted(
                {
                    name
                    for dp in range(source.mds.data_parallel)
                    for group in source._optim_states(stage, 0, dp)["param_slice_mappings"]
                    for name in group
                }
            )
            expected = sorted(n for n, _ in source.stage_parameters(stage))
            if found != expected:
                raise CheckpointError(
                    f"{source.mds.optim_file(stage, 0, 0)}: stage {stage} holds {found[:4]}..., GPTModelPipe's "
                    f"type:transformer split puts {expected[:4]}... there; it was written by another model or split"
                )
        elif not source.flat and source._has_optimizer():
            source._index(stage)
