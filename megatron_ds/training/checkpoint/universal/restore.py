"""Load the universal form into a live engine: each rank takes exactly its own parameters and shards.

For every parameter of the rank's stage (`names.stage_parameters`, checked against the module) the
full tensor is read, this tensor rank's shard cut from it (`sharding.split`) and copied into
  * the model weight (in the model's dtype: bf16 weights are the fp32 masters rounded);
  * with ZeRO-1/2 or bf16 (DeepSpeed's ZeRO and BF16 optimizers keep a flat fp32 partition per
    group and data-parallel rank) and ZeRO-3 (a flat fp32 partition per sub-group, each parameter
    cut over the data-parallel ranks): this rank's fragment of the fp32 master and of each Adam state,
    through DeepSpeed's own fragment mapping (`safe_set_full_fp32_param`,
    `safe_set_full_optimizer_state`), after the flat states are created; a ZeRO-3 weight is written
    into its partitions through `GatheredParameters`;
  * with ZeRO-0 in fp32 (a plain torch optimizer): the parameter's optimizer state.
Placeholders keep their zero value and get zero state. Then DeepSpeed's step counters, the
learning-rate schedule and (fp16 to fp16) the loss scaler are restored.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from megatron_ds.config import Config
from megatron_ds.model import sharding
from megatron_ds.model.gpt_model import gathered
from megatron_ds.pipeline.layout import Layout
from megatron_ds.training.checkpoint.directory import CheckpointError
from megatron_ds.training.checkpoint.universal import names
from megatron_ds.training.checkpoint.universal.deepspeed_source import FP32
from megatron_ds.training.checkpoint.universal.store import Universal
from megatron_ds.training.optimizer import GROUP_NAMES, GROUP_PLACEHOLDER_PREFIX, refresh_fp32_copies
from megatron_ds.training.rank_agreement import fail_together

ReadFull = Callable[[names.ModelTensor], torch.Tensor]
"""Returns one layout-free tensor's full weight."""


def _stage_params(engine: Any, config: Config, layout: Layout) -> list[tuple[names.StageParameter, torch.nn.Parameter]]:
    if config.model.is_moe:
        return _moe_params(engine, config, set(layout.rank_specs(engine.stage_id)))
    params = names.stage_parameters(config.model, layout, engine.stage_id)
    live = dict(engine.module.named_parameters())
    assert [p.module_name for p in params] == list(live), ([p.module_name for p in params], list(live))
    return [(p, live[p.module_name]) for p in params]


def _moe_params(engine: Any, config: Config, specs: set[int]) -> list[tuple[names.StageParameter, torch.nn.Parameter]]:
    """A mixture-of-experts model (T = 1; this pipeline rank's `specs`): every live parameter by its one-process name
    (DeepSpeed's pipeline module names a stage's layers by their global spec index, the tied embedding as at P = 1),
    this rank's experts by their global index; every tensor of its specs but the other ranks' experts is among them."""
    from megatron_ds.model.moe import global_named_parameters, is_expert

    tensors = {names.module_name(config.model, t): t for t in names.model_tensors(config.model)}
    out = []
    for name, param in global_named_parameters(engine.module).items():
        if name.startswith(GROUP_PLACEHOLDER_PREFIX):
            out.append((names.StageParameter(name, name[len(GROUP_PLACEHOLDER_PREFIX) :], None), param))
            continue
        assert name in tensors, (name, sorted(tensors)[:5])
        out.append((names.StageParameter(name, tensors[name].group, tensors[name]), param))
    held = {sp.module_name for sp, _ in out}
    mine = [n for n, t in tensors.items() if t.spec_index in specs and not is_expert(n)]
    assert all(n in held for n in mine), sorted(set(mine) - held)
    return out


def _shard(engine: Any, tensor: names.ModelTensor, full: torch.Tensor) -> torch.Tensor:
    tp = engine.module.tensor_parallel
    return sharding.split(tensor.rule, full, tp.size)[tp.rank] if tp.size > 1 else full


@torch.no_grad()
def load_weights(engine: Any, config: Config, layout: Layout, read_full: ReadFull) -> None:
    """Copy every weight of this rank from `read_full` (cast to the model's dtype), then refresh
    the fp32 copies ZeRO and bf16 optimizers keep (else the first step would write them back)."""
    params = [(sp, param) for sp, param in _stage_params(engine, config, layout) if sp.tensor is not None]
    _check_reads([functools.partial(read_full, sp.tensor) for sp, _ in params])
    for sp, param in params:
        _write_weight(param, _shard(engine, sp.tensor, read_full(sp.tensor)))
    refresh_fp32_copies(engine.optimizer)


@torch.no_grad()
def load_training_state(engine: Any, config: Config, layout: Layout, universal: Universal) -> None:
    """Weights, fp32 masters, optimizer states and step, engine counters, schedule, loss scaler."""
    saved_optimizer = universal.meta["optimizer"]
    if saved_optimizer.get("name") != config.optimizer.optimizer:
        raise CheckpointError(
            f"{universal.directory}: its optimizer state is {saved_optimizer.get('name')}'s, this run uses "
            f"--optimizer {config.optimizer.optimizer}; use the same optimizer or pass --no-load-optim"
        )
    params = _stage_params(engine, config, layout)
    _check_reads(
        [
            functools.partial(universal.read, sp.tensor.name, state)
            for sp, _ in params
            if sp.tensor is not None
            for state in (FP32, *universal.states)
        ]
    )
    steps = {id(p): universal.tensors[sp.tensor.name].get("step") for sp, p in params if sp.tensor is not None}
    target = _optimizer_target(engine.optimizer, universal, steps)
    for sp, param in params:
        if sp.tensor is None:
            continue
        master = _shard(engine, sp.tensor, universal.read(sp.tensor.name, FP32))
        _write_weight(param, master)
        states = {k: _shard(engine, sp.tensor, universal.read(sp.tensor.name, k)) for k in universal.states}
        target.set(param, master, states)
    target.finish([p for sp, p in params if sp.tensor is None])
    _restore_engine(engine, config, universal)


def _check_reads(reads: list[Callable[[], Any]]) -> None:
    """Every read this rank is about to make, made once first, on every rank at once (`fail_together`): ranks read
    different tensors, so a damaged file fails only the ranks that read it, and the writes that follow may be
    collective (a ZeRO-3 weight's gather). A universal file's digest is checked here only (`Universal.read`
    remembers it); another reader's tensors are read twice, one at a time."""
    with fail_together():
        for read in reads:
            read()


def _write_weight(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """`param` = `value` in the model's dtype; a ZeRO-3 partition through a gather (collective)."""
    with gathered([param], modify=True):
        param.data.copy_(value.to(param.dtype))


def _step_state(optimizer: Any, step: int | None) -> dict[str, Any]:
    """An optimizer state's `step` as the optimizer keeps it: DeepSpeed's CPU Adam an int, torch a tensor."""
    if step is None:
        return {}
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return {"step": int(step) if isinstance(optimizer, DeepSpeedCPUAdam) else torch.tensor(float(step))}


Steps = dict[int, "int | None"]
"""The optimizer step count of each live parameter that has a tensor, by `id(param)` (the universal table's)."""


def _group_step(universal: Universal, group: dict[str, Any], params: list[Any], steps: Steps, index: int) -> int | None:
    """The step count of one optimizer group: its parameters' (one optimizer step for all), else, for a group of
    placeholders only, the step of the universal group of its name (a MoE group, `ep_size_E`: by its index's)."""
    found = [steps[id(p)] for p in params if steps.get(id(p)) is not None]
    if found:
        return found[0]
    name = group.get("name")
    return universal.group_step(name if name in GROUP_NAMES else GROUP_NAMES[min(index, 1)])


class _TorchTarget:
    """A plain torch optimizer (ZeRO-0, fp32): its state keyed by parameter; the weight is the master."""

    def __init__(self, optimizer: torch.optim.Optimizer, universal: Universal, steps: Steps) -> None:
        self.optimizer, self.universal = optimizer, universal
        self.step = {
            id(p): steps[id(p)] if id(p) in steps else _group_step(universal, g, g["params"], steps, i)
            for i, g in enumerate(optimizer.param_groups)
            for p in g["params"]
        }

    def set(self, param: torch.nn.Parameter, master: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
        del master  # the fp32 weight itself
        if states:
            self.optimizer.state[param] = {
                **self._step(param),
                **{k: v.to(param.device, copy=True) for k, v in states.items()},
            }

    def finish(self, placeholders: list[torch.nn.Parameter]) -> None:
        for p in placeholders:
            if self.universal.states:
                self.optimizer.state[p] = {**self._step(p), **{k: torch.zeros_like(p) for k in self.universal.states}}

    def _step(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        step = self.step.get(id(param))
        return {} if step is None else {"step": torch.tensor(float(step), dtype=torch.float32)}


class _FlatTarget:
    """DeepSpeed's ZeRO-1/2 or BF16 optimizer: flat fp32 partitions, linked to each parameter by `_hp_mapping`."""

    def __init__(
        self, wrapper: Any, lp_groups: list[list[torch.nn.Parameter]], universal: Universal, steps: Steps
    ) -> None:
        from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

        self.wrapper, self.states = wrapper, universal.states
        base = wrapper.optimizer
        if self.states:  # every group: a MoE model's expert groups follow the two dense ones
            for index, (group, lp) in enumerate(zip(base.param_groups, lp_groups, strict=True)):
                flat = group["params"][0]
                state = {k: torch.zeros_like(flat) for k in self.states}
                base.state[flat] = _step_state(base, _group_step(universal, group, lp, steps, index)) | state
                lazy_init_hp_params_optimizer_state(lp, flat, base.state)  # fragments view the new states
            wrapper._hp_optimizer_states_linked = True

    def set(self, param: torch.nn.Parameter, master: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        safe_set_full_fp32_param(param, master)
        for key, value in states.items():
            safe_set_full_optimizer_state(param, value, key)

    def finish(self, placeholders: list[torch.nn.Parameter]) -> None:
        del placeholders  # zero already: the flat states were created zero


class _Zero3Target(_FlatTarget):
    """DeepSpeed's ZeRO-3 optimizer: a flat fp32 partition per sub-group (its states created here)."""

    def __init__(self, wrapper: Any, universal: Universal) -> None:
        self.wrapper, self.states = wrapper, universal.states
        base = wrapper.optimizer
        for k, flat in enumerate(wrapper.fp32_partitioned_groups_flat if self.states else []):
            name = base.param_groups[wrapper.sub_group_to_group_id[k]].get("name", GROUP_NAMES[0])
            base.state[flat] = _step_state(base, universal.group_step(name)) | {
                key: torch.zeros_like(flat) for key in self.states
            }


class _UnfusedTarget:
    """DeepSpeed's FP16_UnfusedOptimizer (bf16 without ZeRO on the plain engine, a mixture-of-experts model's): an fp32
    copy of each parameter (`fp32_groups`, beside `fp16_groups`), torch's optimizer over the copies."""

    def __init__(self, wrapper: Any, universal: Universal, steps: Steps) -> None:
        self.wrapper, self.universal, self.steps = wrapper, universal, steps
        self.copy = {
            id(p): (copy, _group_step(universal, group, lp, steps, i))
            for i, (group, lp, fp32) in enumerate(
                zip(wrapper.optimizer.param_groups, wrapper.fp16_groups, wrapper.fp32_groups, strict=True)
            )
            for p, copy in zip(lp, fp32, strict=True)
        }

    def set(self, param: torch.nn.Parameter, master: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
        copy, step = self.copy[id(param)]
        copy.data.copy_(master)
        if states:
            self.wrapper.optimizer.state[copy] = _step_state(self.wrapper.optimizer, step) | {
                k: v.to(copy.device, copy=True) for k, v in states.items()
            }

    def finish(self, placeholders: list[torch.nn.Parameter]) -> None:
        for p in placeholders:
            copy, step = self.copy[id(p)]
            copy.data.zero_()
            if self.universal.states:
                self.wrapper.optimizer.state[copy] = _step_state(self.wrapper.optimizer, step) | {
                    k: torch.zeros_like(copy) for k in self.universal.states
                }


def _optimizer_target(optimizer: Any, universal: Universal, steps: Steps) -> Any:
    if getattr(optimizer, "fp32_partitioned_groups_flat", None) is not None:
        return _Zero3Target(optimizer, universal)
    groups = getattr(optimizer, "bit16_groups", None) or getattr(optimizer, "bf16_groups", None)
    if groups is not None:
        return _FlatTarget(optimizer, groups, universal, steps)
    if getattr(optimizer, "fp16_groups", None) is not None and getattr(optimizer, "fp32_groups", None) is not None:
        return _UnfusedTarget(optimizer, universal, steps)
    if isinstance(optimizer, torch.optim.Optimizer):
        return _TorchTarget(optimizer, universal, steps)
    raise CheckpointError(
        f"{universal.directory}: this run's optimizer ({type(optimizer).__name__}: --fp16 without ZeRO) cannot take "
        f"a converted optimizer state; use --zero-stage 1, or pass --no-load-optim"
    )


def _restore_engine(engine: Any, config: Config, universal: Universal) -> None:
    counters = universal.meta["engine"]
    engine.global_steps = counters["global_steps"]
    engine.global_samples = counters["global_samples"]
    engine.skipped_steps = counters["skipped_steps"]
    schedule = universal.lr_scheduler_state()
    if engine.lr_scheduler is not None and schedule is not None:
        engine.lr_scheduler.load_state_dict(schedule)
    scaler = universal.meta["optimizer"].get("loss_scaler")
    source_precision = universal.meta.get("source", {}).get("precision")
    if scaler and config.training.precision == "fp16" and source_precision == "fp16":
        live = getattr(engine.optimizer, "loss_scaler", None)
        for key, value in scaler.items():
            if live is not None and hasattr(live, key):
                setattr(live, key, value)
