"""A Megatron-DeepSpeed mixture-of-experts checkpoint's training state as our full tensors, one at a time.

Upstream's MoE runs (`--num-experts`, GPTModel with `--no-pipeline-parallel` on DeepSpeed's plain engine, T = 1) save,
for W ranks at expert-parallel size E (DeepSpeed's `_save_moe_checkpoint`):

  mp_rank_00_model_states.pt        "module": GPTModel's nested state dict without the experts (the gates, PR-MoE's
                                    residual MLP and coefficient included); the engine's counters and schedule
  layer_<L>_expert_<E>_mp_rank_00_model_states.pt   expert E (global index) of the L-th MoE layer, by its global
                                    GPTModel name (`...mlp.deepspeed_moe.experts.deepspeed_experts.<E>.dense_h_to_4h...`)
  ZeRO 0: expp_rank_<r>_mp_rank_00_optim_states.pt  "optimizer": torch's Adam state of expert-parallel rank r, numbered
                                    group by group over that rank's GPTModel parameters (its local experts included);
                                    groups as Megatron's `get_param_groups` (weight decay, then none), and with
                                    `--create-moe-param-group` the experts' in two groups of their own after those
  ZeRO 1/2: zero_pp_rank_<d>_mp_rank_00_optim_states.pt   rank d's flat fp32 partitions, Adam's state of them and
                                    `param_slice_mappings` by LOCAL names (rank r's experts 0 .. n/E - 1): a dense
                                    parameter partitioned over all W ranks in rank order, an expert over the ranks of
                                    its expert-data-parallel group (DeepSpeed's groups: `layout.expert_places`)

Which global expert a local one is follows from the rank's place in DeepSpeed's groups, computed from W, E and the
saved DeepSpeed JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_ds.interop import megatron_deepspeed_layout as where
from megatron_ds.interop.megatron_deepspeed_files import MegatronDeepSpeedCheckpoint, load_layer
from megatron_ds.interop.megatron_deepspeed_source import MegatronDeepSpeedSource
from megatron_ds.model import naming
from megatron_ds.model.moe import EXPERT_PREFIX
from megatron_ds.training.checkpoint import reader
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.checkpoint.universal.deepspeed_source import FP32, partition_fragment
from megatron_ds.training.checkpoint.universal.names import ModelTensor, model_tensors
from megatron_ds.training.checkpoint.universal.state_files import load_file, materialize

USE_DATA_BEFORE_EXPERT = "use_data_before_expert_parallelism"
"""DeepSpeed JSON key that reorders the expert-parallel groups (`layout.expert_places`)."""


@dataclass(frozen=True)
class UpstreamParameter:
    """One parameter of GPTModel on one expert-parallel rank."""

    name: str
    """Its name there (a local expert by its local index)."""
    shape: tuple[int, ...]
    expert: bool
    tensor: ModelTensor


class MegatronDeepSpeedMoeSource(MegatronDeepSpeedSource):
    """`MegatronDeepSpeedSource` for a `--no-pipeline-parallel` mixture-of-experts checkpoint (P = T = 1, fp32)."""

    def __init__(self, mds: MegatronDeepSpeedCheckpoint, ours: reader.Checkpoint, qkv_layout: str) -> None:
        super().__init__(mds, ours, qkv_layout)
        self.expert_parallel = int(mds.args.get("moe_expert_parallel_size") or 1)
        self.world_size = mds.data_parallel
        self.places = where.expert_places(
            self.world_size, self.expert_parallel, bool(mds.ds_config.get(USE_DATA_BEFORE_EXPERT))
        )
        self.separate_groups = bool(mds.args.get("create_moe_param_group"))
        self.pre = len(naming.gpt_spec_groups(self.model).pre)
        moe_layers = [i for i, n in enumerate(self.model.experts_per_layer) if n > 1]
        self.moe_layer_id = {layer: index for index, layer in enumerate(moe_layers)}  # DeepSpeed's L in file names

    def record(self) -> dict[str, Any]:
        return {**super().record(), "expert_parallel_size": self.expert_parallel, "world_size": self.world_size}

    # ----- names -----------------------------------------------------------------------------------

    def _layer(self, tensor: ModelTensor) -> int:
        return tensor.spec_index - self.pre

    def _expert(self, tensor: ModelTensor) -> tuple[int, int, int] | None:
        """(global expert, its expert-parallel rank, its local index) of an expert's tensor; None otherwise."""
        if not tensor.key.startswith(EXPERT_PREFIX):
            return None
        expert = int(tensor.key[len(EXPERT_PREFIX) :].split(".", 1)[0])
        local = self.model.experts_per_layer[self._layer(tensor)] // self.expert_parallel
        return expert, expert // local, expert % local

    def upstream_name(self, tensor: ModelTensor, local: bool = False) -> str:
        """GPTModel's name of `tensor` (an expert by its global index, or `local`ly as its rank names it)."""
        if not tensor.key.startswith("moe."):
            return where.place(self.model, tensor, no_pipeline=True).module_name
        key = tensor.key
        expert = self._expert(tensor)
        if expert is not None and local:
            key = f"{EXPERT_PREFIX}{expert[2]}.{key[len(EXPERT_PREFIX) :].split('.', 1)[1]}"
        return f"language_model.encoder.layers.{self._layer(tensor)}.{where.moe_key(key)}"

    def rank_parameters(self, rank: int) -> list[UpstreamParameter]:
        """GPTModel's parameters on expert-parallel rank `rank`, in its registration order."""
        out = []
        for t in model_tensors(self.model):
            expert = self._expert(t)
            if expert is not None and expert[1] != rank:
                continue
            out.append(UpstreamParameter(self.upstream_name(t, local=True), t.rule.shape, expert is not None, t))
        return out

    def optimizer_groups(self, rank: int) -> list[list[UpstreamParameter]]:
        """The torch optimizer's groups on expert-parallel rank `rank`: Megatron's weight decay / none (2-D / 1-D),
        and with `--create-moe-param-group` the experts' two after them (DeepSpeed's
        `split_params_into_different_moe_groups_for_optimizer`)."""
        params = self.rank_parameters(rank)
        kinds = [(False, True), (False, False)] + ([(True, True), (True, False)] if self.separate_groups else [])
        return [
            [p for p in params if (p.expert and self.separate_groups) == moe and (len(p.shape) >= 2) == matrix]
            for moe, matrix in kinds
        ]

    # ----- what store.write asks -------------------------------------------------------------------

    def weight(self, tensor: ModelTensor) -> torch.Tensor:
        expert = self._expert(tensor)
        name = self.upstream_name(tensor)
        if expert is None:
            path, value = self.mds.model_states_file(0, 0), self._module(0).get(name)
        else:
            path = self.mds.path(
                f"layer_{self.moe_layer_id[self._layer(tensor)]}_expert_{expert[0]}_mp_rank_00_model_states.pt"
            )
            value = load_layer(path).get(name)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tensor.rule.shape:
            raise CheckpointError(
                f"{path}: no tensor {name!r} of shape {list(tensor.rule.shape)}; the checkpoint is damaged or of another "
                f"model"
            )
        return value.detach().clone()

    def read(self, tensor: ModelTensor, state: str) -> torch.Tensor:
        if state == FP32 and not (self.flat and self._has_optimizer()):
            return self.weight(tensor).float()
        value = self._flat_state(tensor, state) if self.flat else self._torch_state(tensor, state)
        return value.reshape(tensor.rule.shape).float()

    def step(self, tensor: ModelTensor) -> int | None:
        if self.flat:  # the first partition holding a piece of it
            held = ((rank, self._fragment_of(rank, name)) for rank, name in self._holders(tensor))
            rank, found = next(((r, f) for r, f in held if f is not None), (0, None))
            step = None if found is None else self._optim_states(0, 0, rank)["base_optimizer_state"]["state"][found[0]]
            value = None if not step else materialize(step.get("step"), self.mds.optim_file(0, 0, rank))
        else:
            rank, index = self._position(tensor)
            step = self._rank_optimizer(rank)["state"].get(index)
            value = None if not step else step.get("step")
        return None if value is None else int(float(value))

    # ----- ZeRO 0: torch's state by position, per expert-parallel rank --------------------------------

    def expp_file(self, rank: int) -> str:
        return self.mds.path(f"expp_rank_{rank}_mp_rank_00_optim_states.pt")

    def _rank_optimizer(self, rank: int) -> dict[str, Any]:
        path = self.expp_file(rank)
        if path not in self._cache:
            saved = load_file(path).get("optimizer")
            if not isinstance(saved, dict) or "state" not in saved or "param_groups" not in saved:
                raise CheckpointError(f"{path}: no torch optimizer state; the checkpoint is damaged")
            self._cache[path] = saved
        return self._cache[path]

    def _positions(self, rank: int) -> dict[str, Any]:
        """Our tensor name -> its number in rank `rank`'s torch state, checked against the saved groups."""
        key = f"positions{rank}"
        if key in self._cache:
            return self._cache[key]
        saved = self._rank_optimizer(rank)
        groups = self.optimizer_groups(rank)
        counts, expected = [len(g["params"]) for g in saved["param_groups"]], [len(g) for g in groups]
        if counts != expected:
            raise CheckpointError(
                f"{self.expp_file(rank)}: optimizer groups of {counts} parameters, GPTModel's on expert-parallel rank "
                f"{rank} are {expected} (--create-moe-param-group {self.separate_groups}); it was written by another "
                f"model"
            )
        out = {}
        for group, params in zip(saved["param_groups"], groups):
            for index, p in zip(group["params"], params):
                state = saved["state"].get(index, {})
                moment = next((v for v in state.values() if isinstance(v, torch.Tensor) and v.ndim >= 1), None)
                if moment is not None and tuple(moment.shape) != p.shape:
                    raise CheckpointError(
                        f"{self.expp_file(rank)}: parameter {index} has state of shape {list(moment.shape)}, GPTModel's "
                        f"{p.name} is {list(p.shape)}; it was written by another model"
                    )
                out[p.tensor.name] = index
        self._cache[key] = out
        return out

    def _position(self, tensor: ModelTensor) -> tuple[int, Any]:
        expert = self._expert(tensor)
        rank = 0 if expert is None else expert[1]
        return rank, self._positions(rank)[tensor.name]

    def _torch_state(self, tensor: ModelTensor, state: str) -> torch.Tensor:
        rank, index = self._position(tensor)
        value = self._rank_optimizer(rank)["state"].get(index, {}).get(state)
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{self.expp_file(rank)}: no {state} for {self.upstream_name(tensor, local=True)}; the checkpoint is "
                f"damaged"
            )
        return value.detach().clone()

    # ----- ZeRO 1/2: flat partitions by local name, per global rank --------------------------------------

    def _holders(self, tensor: ModelTensor) -> list[tuple[int, str]]:
        """(global rank, local name) of every partition holding `tensor`, in partition order."""
        expert = self._expert(tensor)
        name = self.upstream_name(tensor, local=True)
        if expert is None:
            return [(d, name) for d in range(self.world_size)]
        group = sorted((q, d) for d, (r, q) in enumerate(self.places) if r == expert[1])
        return [(d, name) for _, d in group]

    def _fragment_of(self, rank: int, name: str) -> tuple[int, Any] | None:
        for group, mapping in enumerate(self._optim_states(0, 0, rank)["param_slice_mappings"]):
            if name in mapping:
                return group, mapping[name]
        return None

    def _flat_state(self, tensor: ModelTensor, state: str) -> torch.Tensor:
        pieces = []
        for rank, name in self._holders(tensor):
            found = self._fragment_of(rank, name)
            if found is None:
                continue
            group, fragment = found
            osd = self._optim_states(0, 0, rank)
            pieces.append(partition_fragment(osd, group, fragment, state, self.mds.optim_file(0, 0, rank), name))
        numel = int(torch.Size(tensor.rule.shape).numel())
        if sum(p.numel() for p in pieces) != numel:
            raise CheckpointError(
                f"{self.mds.optim_file(0, 0, 0)}: {self.upstream_name(tensor)} has {sum(p.numel() for p in pieces)} of "
                f"its {numel} elements in the ZeRO partitions; the checkpoint is incomplete"
            )
        return torch.cat(pieces)


def check_moe(source: MegatronDeepSpeedMoeSource) -> None:
    """Before anything is written: each optimizer file holds exactly GPTModel's parameters of its rank."""
    if not source._has_optimizer():
        return
    if not source.flat:
        for rank in range(source.expert_parallel):
            source._positions(rank)
        return
    for d, (r, _) in enumerate(source.places):
        found = sorted(n for g in source._optim_states(0, 0, d)["param_slice_mappings"] for n in g)
        expected = {p.name for p in source.rank_parameters(r)}
        stray = sorted(set(found) - expected)
        if stray:
            raise CheckpointError(
                f"{source.mds.optim_file(0, 0, d)}: holds {stray[:3]}, not GPTModel's on expert-parallel rank {r} of "
                f"{source.expert_parallel}; it was written by another model or expert-parallel size"
            )
