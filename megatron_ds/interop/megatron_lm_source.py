"""A Megatron-LM checkpoint (megatron-core `GPTModel`, `--ckpt-format torch_dist` or `torch`) read as our full
tensors: the reader `converted.write` (and `universal.store.write`) takes for `import_megatron_lm`
(`interop/megatron_lm.py`). Weights come from torch_dist's tensors or each rank's `torch` files; Adam's state and the
fp32 master weights named by model tensor, in the distributed optimizer's dp_reshardable buckets
(`megatron_lm_buckets`), or by parameter number (`megatron_lm_torch_optimizer`); state that does not match the
weights does not convert (`MegatronLMSource.absence` says why). `check_names` holds the checkpoint's tensors to the
model of its saved args before anything is written. The source is only read (`megatron_lm_files`).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from megatron_ds.config.model import GATED_ACTIVATIONS
from megatron_ds.interop import megatron_lm_layout as where
from megatron_ds.interop import megatron_scheduler
from megatron_ds.interop.megatron_deepspeed_layout import qkv_to_blocked
from megatron_ds.interop.megatron_lm_buckets import (
    GATHERED,
    SHARDING_TYPES,
    DistBuckets,
    PlacementError,
    RankBuckets,
    optimizer_step,
)
from megatron_ds.interop.megatron_lm_files import (
    TORCH_DIST,
    DistTensors,
    MegatronLMCheckpoint,
    RankTensors,
)
from megatron_ds.interop.megatron_lm_torch_optimizer import RankParamStates
from megatron_ds.model import sharding
from megatron_ds.training.checkpoint import reader
from megatron_ds.training.checkpoint.directory import META, CheckpointError, fingerprint
from megatron_ds.training.checkpoint.universal.deepspeed_source import FP32
from megatron_ds.training.checkpoint.universal.names import ModelTensor, model_tensors

STATES = ("exp_avg", "exp_avg_sq")
"""Adam's per-tensor states, as megatron-core names them in `optimizer.state.<state>.<tensor>`."""
MASTERS = ("param", "fp32_param")
"""The fp32 master weight's state name: the distributed optimizer's, then the local float16 optimizer's."""


class MegatronLMSource:
    """Reads `mlm` for the converted checkpoint `ours` (its config and metadata, already written): the
    reader `converted.write` takes: the weights, and Adam's state where it converts."""

    def __init__(self, mlm: MegatronLMCheckpoint, ours: reader.Checkpoint) -> None:
        self.mlm, self.ckpt = mlm, ours
        self.model = ours.config.model
        self.tensor_parallel = mlm.tensor_parallel
        self.dist = DistTensors(mlm.directory) if mlm.format == TORCH_DIST else None
        self.ranks = None if self.dist is not None else RankTensors(mlm)
        self.buckets: DistBuckets | None = None
        """torch_dist: the distributed optimizer's dp_reshardable buckets, placed (None: named by tensor)."""
        self.rank_states: RankBuckets | RankParamStates | None = None
        """torch: each rank's optimizer state (the distributed optimizer's `distrib_optim.pt`, or torch's in
        `model_optim_rng.pt`), placed."""
        self.absence = ""
        """Why optimizer state the checkpoint holds does not convert ("" when it does or there is none)."""
        self._states = self._find_states()

    # ----- what store.write and converted.write ask -----------------------------------------------

    def state_keys(self) -> list[str]:
        """Adam's states when the checkpoint names them by model tensor (else [])."""
        return list(self._states)

    def _find_states(self) -> tuple[str, ...]:
        """Once, at the start: whether the first model tensor has an `optimizer.state.exp_avg.` entry."""
        if self.mlm.optimizer is None:
            return ()
        chained = _chained(self.mlm.optimizer)
        sharding = chained[0].get("param_state_sharding_type")
        if len(chained) > 1 and (self.dist is None or sharding in SHARDING_TYPES or sharding == GATHERED):
            self.absence = (
                f"its optimizer state is megatron-core's ChainedOptimizer's (several optimizers, e.g. a mixture of "
                f"experts' dense and expert parameters apart) in "
                f"{'--ckpt-format torch files' if self.dist is None else f'{sharding} buffers'}, which are not read "
                f"here; to keep it, load the checkpoint in Megatron-LM and save it as torch_dist (with "
                f"--dist-ckpt-optim-fully-reshardable if it uses the distributed optimizer)"
            )
            return ()
        if self.dist is None:
            return self._place_rank_states()
        if sharding in SHARDING_TYPES or sharding == GATHERED:
            return self._place_buckets(sharding)
        candidates, layer = where.names(self.model, model_tensors(self.model)[0])
        key = self._state_key(model_tensors(self.model)[0], STATES[0])
        weight = self._dist_key(candidates, layer)
        if key is None or weight is None:
            return ()
        if self.dist.shape(key) != self.dist.shape(weight):  # e.g. megatron-core's flattened fully_sharded_model_space
            self.absence = (
                f"its optimizer state ({sharding or 'by tensor'}) is stored as {key} of shape {list(self.dist.shape(key))}, not its "
                f"weight's {list(self.dist.shape(weight))}, a layout that does not convert; to keep it, load the "
                f"checkpoint in Megatron-LM and save it with --dist-ckpt-optim-fully-reshardable"
            )
            return ()
        mislabeled = self._master_not_its_weight()
        if mislabeled is not None:
            self.absence = (
                f"its optimizer state is saved under the wrong tensor names ({mislabeled}'s fp32 master does not "
                f"round to its weight: megatron-core 0.16's --dist-ckpt-optim-fully-reshardable slices each tensor's "
                f"state at its bucket-padded position in buffers saved without that padding, so runs with several "
                f"DDP buckets are shifted); to keep it, save the run with the default dp_reshardable layout"
            )
            return ()
        return STATES

    def _master_not_its_weight(self) -> str | None:
        """The first tensor whose saved fp32 master (`param` or `fp32_param`) does not round to its saved
        weight exactly (megatron-core copies the masters into the weights after every step), or None; None
        also when no masters are saved (a run without --use-distributed-optimizer in fp32)."""
        assert self.dist is not None
        for tensor in model_tensors(self.model):
            candidates, layer = where.names(self.model, tensor)
            weight_key = self._dist_key(candidates, layer)
            master_key = next((k for m in MASTERS if (k := self._state_key(tensor, m)) is not None), None)
            if weight_key is None or master_key is None:
                continue
            weight = self.dist.read(weight_key, layer, where.expert(tensor))
            if not torch.equal(self.dist.read(master_key, layer, where.expert(tensor)).to(weight.dtype), weight):
                return weight_key if layer is None else f"{weight_key}[{layer}]"
        return None

    def _place_buckets(self, sharding: str) -> tuple[str, ...]:
        assert self.dist is not None
        try:
            gated = self.model.activation in GATED_ACTIVATIONS
            self.buckets = DistBuckets(self.dist, sorted(stored_names(self)), gated, gathered=sharding == GATHERED)
        except PlacementError as err:
            self.absence = (
                f"its optimizer state is in the distributed optimizer's {sharding} buffers, which do not match "
                f"its weights ({err}); to keep it, load the checkpoint in Megatron-LM and save it with "
                f"--dist-ckpt-optim-fully-reshardable"
            )
            return ()
        return STATES

    def _place_rank_states(self) -> tuple[str, ...]:
        assert self.ranks is not None
        buckets = bool(self.mlm.args.get("use_distributed_optimizer"))  # its distrib_optim.pt files must be there
        kind = RankBuckets if buckets else RankParamStates
        try:
            self.rank_states = kind(self.mlm, self.ranks, where.IGNORED_SUFFIXES)
        except PlacementError as err:
            file = "the distributed optimizer's distrib_optim.pt" if buckets else "model_optim_rng.pt"
            self.absence = f"its optimizer state ({file}) does not match its weights ({err})"
            return ()
        return STATES

    def step(self, tensor: ModelTensor) -> int | None:
        """Adam's step: the distributed optimizer's param groups' `step`, or the local one's `common_step`."""
        steps: set[float] = set()
        for saved in _chained(self.mlm.optimizer or {}):
            groups = (saved.get("optimizer") or saved).get("param_groups") or []
            steps |= {float(g["step"]) for g in groups if isinstance(g, dict) and "step" in g}
            common = (saved.get("state") or {}).get("common_step")
            if common is not None:
                steps.add(float(common))
        if self.buckets is not None:
            steps |= optimizer_step(self.buckets.dist)
        if isinstance(self.rank_states, RankParamStates):
            steps |= self.rank_states.steps
        if len(steps) != 1:
            raise CheckpointError(
                f"{self.mlm.directory}: its optimizer's step is {sorted(steps) or 'missing'}; expected one step count"
            )
        return int(steps.pop())

    def read(self, tensor: ModelTensor, state: str) -> torch.Tensor:
        """`state` (FP32: the fp32 master where saved, else the weight; or an Adam state) as our full fp32 tensor."""
        if self.buckets is not None:
            return self._from_dist(tensor, "param" if state == FP32 else state).contiguous()
        if self.rank_states is not None:
            return self._from_ranks(tensor, "param" if state == FP32 else state).float()
        if state == FP32:
            master = next((m for m in MASTERS if self._optimizer_key(tensor, m) is not None), None)
            return (self.weight(tensor) if master is None else self._optimizer_state(tensor, master)).float()
        return self._optimizer_state(tensor, state).float()

    def _optimizer_key(self, tensor: ModelTensor, state: str) -> str | None:
        return self._state_key(tensor, state) if self._states else None

    def _state_key(self, tensor: ModelTensor, state: str) -> str | None:
        """torch_dist's name of `state` of `tensor`: `optimizer.state.<state>.<tensor>`, or a ChainedOptimizer's saved
        by megatron-core before 0.14 (or with --dist-ckpt-save-pre-mcore-014): `chained_<i>.optimizer.state...`,
        i the optimizer holding it (a mixture of experts: 0 the dense parameters, 1 the experts)."""
        candidates, layer = where.names(self.model, tensor)
        chained = range(len(_chained(self.mlm.optimizer or {})))
        prefixes = ["optimizer.state.", *(f"chained_{i}.optimizer.state." for i in chained)]
        return next((k for p in prefixes if (k := self._dist_key(candidates, layer, f"{p}{state}.")) is not None), None)

    def _optimizer_state(self, tensor: ModelTensor, state: str) -> torch.Tensor:
        assert self.dist is not None
        key = self._optimizer_key(tensor, state)
        if key is None:
            name = where.names(self.model, tensor)[0][0]
            raise CheckpointError(
                f"{self.mlm.directory}: no optimizer.state.{state} of {name}; the checkpoint is incomplete"
            )
        full = self._read_dist(tensor, key)
        if tuple(full.shape) != tensor.rule.shape:
            raise CheckpointError(
                f"{self.mlm.directory}: {key} has shape {list(full.shape)}, not {list(tensor.rule.shape)}"
            )
        return full.contiguous()

    def weight(self, tensor: ModelTensor) -> torch.Tensor:
        """The model's weight as the checkpoint stores it (its dtype), as our full tensor."""
        full = self._from_dist(tensor) if self.dist is not None else self._from_ranks(tensor)
        if tuple(full.shape) != tensor.rule.shape:
            raise CheckpointError(
                f"{self.mlm.directory}: {where.names(self.model, tensor)[0][0]} has shape {list(full.shape)}, its "
                f"saved args imply {list(tensor.rule.shape)}; the checkpoint is damaged"
            )
        return full.contiguous()

    def engine_state(self) -> dict[str, Any]:
        state = self.ckpt.meta["train_state"]
        saved = self.mlm.states.get("opt_param_scheduler")
        schedule = (
            megatron_scheduler.schedule_state(saved, self.ckpt.config, self.mlm.directory)
            if isinstance(saved, dict)
            else None
        )
        return {
            "global_steps": state["iteration"],
            "global_samples": state["consumed_train_samples"],
            "skipped_steps": 0,
            "lr_scheduler": schedule,
        }

    def loss_scaler(self) -> dict[str, Any] | None:
        return None

    def record(self) -> dict[str, Any]:
        m = self.mlm
        return {
            "format": "megatron-lm",
            "ckpt_format": m.format,
            "directory": m.directory,
            "fingerprint": fingerprint(os.path.join(self.ckpt.directory, META)),
            "pipeline_model_parallel_size": m.pipeline_parallel,
            "tensor_model_parallel_size": m.tensor_parallel,
            "precision": m.precision,
        }

    # ----- upstream's files -------------------------------------------------------------------------

    def _from_dist(self, tensor: ModelTensor, state: str | None = None) -> torch.Tensor:
        """The weight (or, from the distributed optimizer's buckets, state `state`) as our full tensor."""
        assert self.dist is not None
        candidates, layer = where.names(self.model, tensor)
        key = self._dist_key(candidates, layer)
        if key is None:
            raise CheckpointError(
                f"{self.mlm.directory}: no tensor {candidates[0]!r}; the checkpoint is of another model"
            )
        return self._read_dist(tensor, key, state)

    def _read_dist(self, tensor: ModelTensor, key: str, state: str | None = None) -> torch.Tensor:
        """Stored tensor `key` (the weight or an optimizer state of `tensor`; with `state`, that state of
        weight `key` from the buckets) in our row order, T=1."""
        assert self.dist is not None
        layer = where.names(self.model, tensor)[1]
        if state is None:
            full = self.dist.read(key, layer, where.expert(tensor))
        else:
            assert self.buckets is not None
            full = self.buckets.read(key, state, layer)
        return qkv_to_blocked(full, self.model, 1) if tensor.key in where.FUSED_QKV else full

    def _dist_key(self, candidates: tuple[str, ...], layer: int | None, prefix: str = "") -> str | None:
        assert self.dist is not None
        keys = [prefix + (where.LAYERS + c if layer is not None else c) for c in candidates]
        return next((k for k in keys if k in self.dist.tensors), None)

    def _from_ranks(self, tensor: ModelTensor, state: str | None = None) -> torch.Tensor:
        """The weight (or, with the distributed optimizer's files, optimizer state `state`) as our full tensor."""
        assert self.ranks is not None
        candidates, layer = where.names(self.model, tensor)
        found = self.ranks.find(candidates, layer)
        if found is None:
            raise CheckpointError(
                f"{self.mlm.directory}: no tensor {candidates[0]!r}; the checkpoint is of another model"
            )
        if state is None:
            shards = self.ranks.shards(*found)
        else:
            assert self.rank_states is not None
            shards = [self.rank_states.shard(found[0], r, found[1], state) for r in range(self.tensor_parallel)]
        if tensor.key in where.FUSED_QKV:
            shards = [qkv_to_blocked(s, self.model, self.tensor_parallel) for s in shards]
        if tensor.rule.split == sharding.REPLICATED and sharding.replicas_differ(shards):
            raise CheckpointError(
                f"{self.mlm.directory}: {found[1]} differs between tensor-parallel ranks; it is damaged"
            )
        return sharding.gather(tensor.rule, shards)


_OPTIMIZER = re.compile(r"^(chained_\d+\.)?optimizer\.")
"""torch_dist's optimizer entries (a ChainedOptimizer's buffers prefixed by the optimizer's number)."""


def _chained(saved: dict[Any, Any]) -> list[dict[str, Any]]:
    """The saved optimizer's state dicts: megatron-core's ChainedOptimizer (a mixture of experts' dense and expert
    optimizers) saves one per sub-optimizer under 0, 1, ...; a single optimizer its own."""
    if saved and all(isinstance(k, int) for k in saved):
        return [v for _, v in sorted(saved.items()) if isinstance(v, dict)]
    return [saved]


def stored_names(source: MegatronLMSource) -> set[str]:
    """The model tensors the checkpoint stores (names as stored; the optimizer's and non-weights left out)."""
    if source.dist is not None:
        keys = set(source.dist.tensors)
        return {k for k in keys if not _OPTIMIZER.match(k) and not k.endswith(where.IGNORED_SUFFIXES)}
    assert source.ranks is not None
    return {
        f"{stage}:{k}"
        for stage in range(source.mlm.pipeline_parallel)
        for k in source.ranks.keys(stage)
        if not k.endswith(where.IGNORED_SUFFIXES)
    }


def check_names(source: MegatronLMSource) -> None:
    """Every stored model tensor is one the converted model takes (else the model is another: MoE
    experts, QK norms, a second embedding...), before anything is written."""
    used: set[str] = set()
    for tensor in model_tensors(source.model):
        candidates, layer = where.names(source.model, tensor)
        if source.dist is not None:
            key = source._dist_key(candidates, layer)
        else:
            assert source.ranks is not None
            found = source.ranks.find(candidates, layer)
            key = None if found is None else f"{found[0]}:{found[1]}"
        if key is None:
            at = "" if layer is None else f" of layer {layer}"
            raise CheckpointError(
                f"{source.mlm.directory}: no tensor {candidates[0]!r}{at}, which the model of its saved args has; "
                f"the checkpoint is incomplete or of another model"
            )
        used.add(key)
    if source.ranks is not None and not source.model.untie_embeddings_and_output_weights:
        used |= {n for n in stored_names(source) if n.endswith(":output_layer.weight")}  # the last stage's tied copy
    left = sorted(stored_names(source) - used)
    if left:
        raise CheckpointError(
            f"{source.mlm.directory}: holds {len(left)} tensor(s) the model of its saved args does not have "
            f"({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}); it was written by another model"
        )
