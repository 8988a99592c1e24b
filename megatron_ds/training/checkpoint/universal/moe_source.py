"""Read a mixture-of-experts checkpoint (DeepSpeed's MoE files, plain engine, P = T = 1) as whole tensors by name; the
same saved at P > 1 (each stage's files) is `moe_pipeline_source`'s, through the few placement methods it overrides.

Where each part of the training state is, for W ranks at expert-parallel size E (`save_load.save`, DeepSpeed's
`_save_moe_checkpoint`; `experts.json` says which expert-parallel rank r and expert-data-parallel rank q each global
rank d had, and each r's optimizer groups by one-process name: `training/checkpoint/experts.py`):

  weights          mp_rank_00_model_states.pt "module": every parameter but the experts (the gates included);
                   layer_<l>_expert_<e>_mp_rank_00_model_states.pt: expert e of the l-th MoE layer, by global name
  ZeRO 0           expp_rank_<r>_mp_rank_00_optim_states.pt "optimizer": rank r's optimizer state by position over
                   its parameters (`experts.json`'s optimizer_groups[r]); fp32: torch's state dict (the fp32 master is
                   the weight); bf16: FP16_UnfusedOptimizer's, its `fp32_groups` the masters and
                   `optimizer_state_dict` torch's state
  ZeRO 1/2         [bf16_]zero_pp_rank_<d>_mp_rank_00_optim_states.pt: each group's flat fp32 partition, Adam's
                   state of it and `param_slice_mappings` by rank d's LOCAL names; a dense parameter is partitioned
                   over all W ranks (in rank order), an expert of rank r's over the W / E ranks of r's
                   expert-data-parallel group (in q order), where its local index is e mod (experts / E)
  engine state     mp_rank_00_model_states.pt: global_steps, global_samples, skipped_steps, lr_scheduler
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_ds.model import naming
from megatron_ds.model.moe import EXPERT_PREFIX
from megatron_ds.training.checkpoint import experts, moe_weights
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.checkpoint.universal import names
from megatron_ds.training.checkpoint.universal.deepspeed_source import (
    FP32,
    DeepSpeedSource,
    _int,
    partition_fragment,
)
from megatron_ds.training.checkpoint.universal.state_files import materialize


class MoeSource(DeepSpeedSource):
    """`DeepSpeedSource` for a mixture-of-experts checkpoint."""

    def __init__(self, ckpt: Any) -> None:
        super().__init__(ckpt)
        cfg = ckpt.config
        self.flat = cfg.training.zero_stage >= 1  # bf16 without ZeRO: DeepSpeed's FP16_UnfusedOptimizer, by position
        self.world_size = int(ckpt.meta.get("world_size") or 0)
        self.expert_parallel = cfg.parallel.expert_parallel_size
        self.experts = experts.read(ckpt.directory, self.world_size, self.expert_parallel)

    # --- what a checkpoint saved at P > 1 places per stage (`moe_pipeline_source` overrides these) ---------------
    def _stage(self, tensor: names.ModelTensor) -> int:
        """The pipeline stage whose files hold `tensor`."""
        return 0

    def _stage_ranks(self, stage: int) -> list[int]:
        """The global ranks of `stage`, in their data-parallel order (the index of their ZeRO files)."""
        return list(range(self.world_size))

    def _zero_file(self, rank: int) -> str:
        """Global rank `rank`'s ZeRO partition file."""
        return self.optim_file(0, 0, rank)

    def _recorded_groups(self, stage: int, rank: int) -> list[list[str]]:
        """Expert-parallel rank `rank`'s optimizer groups on `stage`, by one-process name (`experts.json`)."""
        return self.experts["optimizer_groups"][rank]

    def _optimizer_file(self, stage: int, rank: int) -> str:
        """The file whose "optimizer" is expert-parallel rank `rank`'s optimizer state on `stage` (ZeRO 0)."""
        return self.expp_file(rank, stage)

    def _weight_location(self, tensor: names.ModelTensor) -> tuple[str, str | None, str]:
        """(file, key of the state dict in it or None, name there) of `tensor`'s saved weight."""
        return (*moe_weights.weight_file(self.model, tensor), names.module_name(self.model, tensor))

    def record(self) -> dict[str, Any]:
        return {**super().record(), "expert_parallel_size": self.expert_parallel, "world_size": self.world_size}

    # --- where a tensor is ------------------------------------------------------------------------------------
    def _expert(self, tensor: names.ModelTensor) -> tuple[int, int, str] | None:
        """(global expert, its expert-parallel rank, its local module name) of an expert's tensor; None otherwise."""
        if not tensor.key.startswith(EXPERT_PREFIX):
            return None
        index, rest = tensor.key[len(EXPERT_PREFIX) :].split(".", 1)
        expert = int(index)
        local = self.model.experts_per_layer[tensor.spec_index - len(naming.gpt_spec_groups(self.model).pre)]
        local //= self.expert_parallel
        return expert, expert // local, f"{tensor.spec_index}.{EXPERT_PREFIX}{expert % local}.{rest}"

    def _holders(self, tensor: names.ModelTensor) -> list[tuple[int, str]]:
        """(global rank, its module name) of every ZeRO partition holding `tensor`, in partition order."""
        expert = self._expert(tensor)
        if expert is None:
            return [(d, names.module_name(self.model, tensor)) for d in self._stage_ranks(self._stage(tensor))]
        _, owner, local = expert
        ranks = self.experts["ranks"]
        group = sorted(
            (ranks[d]["expert_data_parallel_rank"], d)
            for d in self._stage_ranks(self._stage(tensor))
            if ranks[d]["expert_parallel_rank"] == owner
        )
        return [(d, local) for _, d in group]

    def _owner(self, tensor: names.ModelTensor) -> int:
        expert = self._expert(tensor)
        return 0 if expert is None else expert[1]

    def expp_file(self, rank: int, stage: int = 0) -> str:
        return self._path(f"expp_rank_{rank}_mp_rank_{self._mp(stage, 0):02d}_optim_states.pt")

    def _position(self, tensor: names.ModelTensor) -> tuple[int, int, int]:
        """(group, index in the group, index in torch's state dict) of `tensor` in its expert-parallel rank's file."""
        stage, rank = self._stage(tensor), self._owner(tensor)
        key = f"#positions{stage}.{rank}"
        if key not in self._meta_cache:
            recorded = self._recorded_groups(stage, rank)
            saved = self._torch_state(stage, rank)
            counts = [len(g["params"]) for g in saved.get("param_groups", [])]
            if counts != [len(g) for g in recorded]:
                raise CheckpointError(
                    f"{self._optimizer_file(stage, rank)}: optimizer groups of {counts} parameters, "
                    f"{experts.EXPERTS_FILE} records {[len(g) for g in recorded]}; the checkpoint is damaged"
                )
            flat = [(g, i, name) for g, group in enumerate(recorded) for i, name in enumerate(group)]
            self._meta_cache[key] = {name: (g, i, n) for n, (g, i, name) in enumerate(flat)}
        found = self._meta_cache[key].get(names.module_name(self.model, tensor))
        if found is None:
            raise CheckpointError(
                f"{self._optimizer_file(stage, rank)}: {experts.EXPERTS_FILE} records no "
                f"{names.module_name(self.model, tensor)} on expert-parallel rank {rank}; the checkpoint is damaged or "
                f"of another model"
            )
        return found

    # --- what is read -----------------------------------------------------------------------------------------
    def _optimizer(self, stage: int, rank: int) -> dict[str, Any]:
        path = self._optimizer_file(stage, rank)
        saved = self.files.open(path).get("optimizer")  # tensors on the meta device
        if not isinstance(saved, dict):
            raise CheckpointError(f"{path}: no optimizer state; the checkpoint is damaged")
        return saved

    def _torch_state(self, stage: int, rank: int) -> dict[str, Any]:
        saved = self._optimizer(stage, rank)
        return saved if self.precision == "fp32" else saved["optimizer_state_dict"]

    def _first_optimizer_state(self) -> dict[str, Any]:
        return super()._first_optimizer_state() if self.flat else self._torch_state(0, 0)

    def read(self, tensor: names.ModelTensor, state: str) -> torch.Tensor:
        """`state` (FP32 or an optimizer state) of `tensor`, whole."""
        shape = tensor.rule.shape
        if self.flat:
            value, path = self._joined(tensor, state), self.ckpt.directory
        elif state == FP32 and self.precision == "fp32":
            value, path = self._weight(tensor)
        else:
            g, i, n = self._position(tensor)
            stage, rank = self._stage(tensor), self._owner(tensor)
            path = self._optimizer_file(stage, rank)
            try:
                if state == FP32:
                    value = self._optimizer(stage, rank)["fp32_groups"][g][i]
                else:
                    value = self._torch_state(stage, rank)["state"][n][state]
            except (KeyError, IndexError, TypeError) as err:
                raise CheckpointError(
                    f"{path}: no {state} for {names.module_name(self.model, tensor)} ({err}); the checkpoint is damaged"
                ) from None
        if not isinstance(value, torch.Tensor) or value.numel() != torch.Size(shape).numel():
            raise CheckpointError(
                f"{self.ckpt.directory}: no {state} of shape {list(shape)} for {tensor.name}; the checkpoint is damaged"
            )
        return materialize(value, path).reshape(shape).float()

    def _weight(self, tensor: names.ModelTensor) -> tuple[torch.Tensor, str]:
        file, key, name = self._weight_location(tensor)  # the model-state file, or the expert's own
        path = self._path(file)
        weights = self.files.open(path)
        weights = (weights.get(key) or {}) if key is not None else weights
        if name not in weights:
            raise CheckpointError(f"{path}: no {name}; the checkpoint is damaged or of another model")
        return weights[name], path

    def _joined(self, tensor: names.ModelTensor, state: str) -> torch.Tensor:
        """The fragments of every ZeRO partition holding `tensor`, in partition order."""
        pieces = []
        for rank, module_name in self._holders(tensor):
            found = self._fragment_of(rank, module_name)
            if found is None:
                continue
            path, g, fragment = found
            osd = self.files.open(path)["optimizer_state_dict"]
            pieces.append(partition_fragment(osd, g, fragment, state, path, module_name))
        if not pieces:
            raise CheckpointError(
                f"{self.ckpt.directory}: no ZeRO partition holds {tensor.name}; the checkpoint is damaged"
            )
        return torch.cat(pieces)

    def _fragment_of(self, rank: int, module_name: str) -> tuple[str, int, Any] | None:
        """(file, group, fragment) of `module_name` in global rank `rank`'s ZeRO file; None when it holds none of it."""
        path = self._zero_file(rank)
        for g, mapping in enumerate(self.files.open(path)["optimizer_state_dict"]["param_slice_mappings"]):
            if module_name in mapping:
                return path, g, mapping[module_name]
        return None

    def step(self, tensor: names.ModelTensor) -> int | None:
        """The optimizer's step count for `tensor` (None before the first step)."""
        if not self.flat:
            _, _, n = self._position(tensor)
            stage, rank = self._stage(tensor), self._owner(tensor)
            step = self._torch_state(stage, rank)["state"].get(n, {}).get("step")
            return _int(materialize(step, self._optimizer_file(stage, rank)))
        for rank, module_name in self._holders(tensor):
            found = self._fragment_of(rank, module_name)
            if found is not None:
                path, g, _ = found
                step = self.files.open(path)["optimizer_state_dict"]["base_optimizer_state"]["state"][g].get("step")
                return _int(materialize(step, path))
        return None
