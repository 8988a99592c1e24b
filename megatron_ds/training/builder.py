"""The public builder: a config in, a DeepSpeed pipeline engine out that keeps, by itself, the
invariants that prevent hangs and wrong gradient norms, so no training loop (ours or yours) has to.

    import megatron_ds
    with megatron_ds.build_pipeline(config, optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3)) as pipe:
        for _ in range(num_steps):
            loss = pipe.train_batch(data_iter)

What `build_pipeline` does, in order (docs/training.md says why each step matters):
1. the layout comes from the config (`resolve_layout`, the one place a run resolves it) unless
   one is passed, and must have `pipeline_model_parallel_size` stages: the stage count is given once;
2. the DeepSpeed JSON is generated from the config (`deepspeed_config.build`), a user file or
   dict merged in, contradictions refused: all before any process group exists;
3. `GPTModelPipe` marks each parameter on the one rank that counts it in the global norm;
4. every stage gets the same optimizer groups (`add_group_placeholders`);
5. the preflight check compares every rank's structure before the first step (`check_structure`);
6. the no-ZeRO fp32 clip uses the counted norm (`install_fp32_grad_norm`; a MoE model's bf16/fp16 one too,
   `install_mixed_precision_expert_norm`), and each training
   forward reseeds the stage's dropout streams from the global micro-batch index
   (`rng.install_micro_batch_seeding`: masks independent of layout, P, DP and interruptions);
7. `Pipeline.train_batch`, `eval_batch` and `watch` run under the step watchdog, and
   `Pipeline.close` (or leaving its `with` block) destroys the process groups;
8. deepspeed.checkpointing is configured with the config's options (`activation_checkpointing`: its
   contiguous buffers sized for what this rank keeps, emptied around evaluation forwards);
9. the engine's instructions are timed (`stage_timers.install`): `Pipeline.timers` holds each
   stage's compute per step, apart from the time it waits.
A layout that depends on timing this machine (`--pp-partition-method profile`) is built after the
process group exists, from rank 0's measurement, so every rank builds the same one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from megatron_ds.config import Config
from megatron_ds.distributed import env_world_size, init_distributed, shutdown_distributed
from megatron_ds.errors import ConfigError
from megatron_ds.estimate import pipeline_schedules
from megatron_ds.estimate.machine import check_runs_on, for_layout
from megatron_ds.estimate.measured_time import Calibration
from megatron_ds.estimate.run_layout import uses_measured_times
from megatron_ds.model import moe, rng, tensor_parallel
from megatron_ds.model.gpt_chunks import ChunkedGPTModelPipe
from megatron_ds.model.gpt_model import GPTModel
from megatron_ds.model.gpt_pipe import GPTModelPipe, build_topology
from megatron_ds.pipeline.layout import Layout
from megatron_ds.training import (
    activation_checkpointing,
    deepspeed_config,
    interleaved,
    moe_pipeline,
    pipe_schedules,
    plain_engine,
    zero_bubble,
)
from megatron_ds.training.dependencies import check_deepspeed
from megatron_ds.training.grad_norm import grad_norm, install_fp32_grad_norm, install_mixed_precision_expert_norm
from megatron_ds.training.machine import probe
from megatron_ds.training.measure import stage_timers
from megatron_ds.training.optimizer import (
    OptimizerFactory,
    add_group_placeholders,
    build_optimizer,
    refresh_fp32_copies,
)
from megatron_ds.training.preflight import Watchdog, check_run_agreement, check_structure
from megatron_ds.training.resolve_layout import measure, resolve_layout


@dataclass
class Pipeline:
    """A built pipeline: DeepSpeed's engine, the pieces it was built from, and guarded steps."""

    engine: Any  # deepspeed's PipelineEngine, or `plain_engine.PlainEngine` (ZeRO 2/3 at P = 1)
    model: GPTModelPipe | GPTModel
    optimizer: torch.optim.Optimizer  # as deepspeed.initialize returned it (wrapped under ZeRO/bf16)
    ds_config: dict[str, Any]
    layout: Layout
    watchdog: Watchdog
    timers: stage_timers.StageTimers
    """Per-instruction times of `train_batch` (`summary(rank)`: compute per step apart from waiting)."""
    calibration: Calibration | None = None
    """Rank 0's measurement the layout was built from (`profile`), else None."""

    def train_batch(self, data_iter: Iterator[Any] | None = None, label: str | None = None) -> torch.Tensor:
        """One optimizer step (`engine.train_batch`) under the watchdog; returns the mean loss.

        Only the first and last stages read `data_iter`: ((tokens,), (labels, loss_mask)) per micro-batch.
        """
        with self.watch(label or f"train_batch at iteration {self.engine.global_steps + 1}"):
            return self.engine.train_batch(data_iter=data_iter)

    def eval_batch(self, data_iter: Iterator[Any] | None = None, label: str | None = None) -> torch.Tensor:
        """One forward-only batch (`engine.eval_batch`) under the watchdog; returns the mean loss."""
        with self.watch(label or f"eval_batch after iteration {self.engine.global_steps}"):
            return self.engine.eval_batch(data_iter=data_iter)

    def watch(self, label: str) -> AbstractContextManager[None]:
        """Run anything else collective (a checkpoint save, say) under the watchdog: a stall past
        `distributed_timeout_minutes` prints rank, stage, `label` and every stack, then exits."""
        return self.watchdog.watch(label)

    def grad_norm(self) -> float | None:
        """The last step's global gradient norm (before clipping), or None where DeepSpeed keeps none."""
        return grad_norm(self.engine)

    def close(self, clean: bool = True) -> None:
        """Destroy every process group (`megatron_ds.distributed.shutdown_distributed`);
        `clean=False` after an error skips the closing barrier."""
        shutdown_distributed(clean=clean)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(clean=exc_type is None)


def build_pipeline(
    config: Config,
    optimizer: OptimizerFactory | None = None,
    ds_config: dict[str, Any] | None = None,
    layout: Layout | None = None,
    lr_scheduler: Any | None = None,
    on_layout: Callable[[Layout, Calibration | None], None] | None = None,
) -> Pipeline:
    """Build the GPT pipeline and its DeepSpeed engine with every invariant in place (see the module).

    Args:
        config: the run; `config.parallel`'s pipeline x tensor x data sizes must equal the world size.
        optimizer: a factory taking the parameter groups (dicts with "name", "params", "weight_decay"
            from `config.optimizer.weight_decay`) and returning a torch optimizer; None builds the one
            `config.optimizer` describes, as pretrain_gpt.py does.
        ds_config: DeepSpeed keys merged into the generated JSON with the rules of a
            `--deepspeed_config` file: a key that contradicts the config is a DeepSpeedConfigError.
        layout: the stage layout; None builds it from `config.parallel`'s layout options.
        lr_scheduler: given to `deepspeed.initialize`: a scheduler, or a callable taking the optimizer.
        on_layout: called on every rank with the layout (and `profile`'s calibration) as soon as it
            is resolved, before the model is built (`pretrain_gpt.py` prints it there).

    Initialises torch.distributed from the launcher's environment unless it already is; if building
    fails after that, the process groups it created are destroyed before the error propagates.
    """
    if optimizer is not None and not callable(optimizer):
        raise TypeError(
            f"build_pipeline(optimizer=...) takes a callable that builds the optimizer from parameter groups, "
            f"got {type(optimizer).__name__}; describe the default optimizer in config.optimizer instead"
        )
    local = probe()
    check_runs_on(config, local)
    check_deepspeed(config)  # a release that trains this run wrongly: refused before any process group
    machine = for_layout(config, local)  # --pp-device: the layout of the GPUs it names
    measured = layout is None and uses_measured_times(config)  # built once the ranks can agree
    layout = resolve_layout(config, machine=machine) if layout is None and not measured else layout
    _check_sizes(config, layout)
    ds = deepspeed_config.build(config, ds_config)
    pipe_schedules.check_deepspeed_config(config.parallel.pipeline_schedule, ds)
    created = not torch.distributed.is_initialized()
    init_distributed(config.parallel)
    try:
        check_run_agreement(config, layout)  # the first collective: every rank runs the same schedule
        calibration = _agreed_calibration(config) if measured else None
        if measured:
            layout = resolve_layout(config, calibration, machine)
        if on_layout is not None:
            on_layout(layout, calibration)
        return _assemble(config, layout, ds, optimizer, lr_scheduler, calibration)
    except BaseException:
        if created:
            shutdown_distributed(clean=False)
        raise


def _agreed_calibration(config: Config) -> Calibration:
    """Rank 0 times the groups (`profile`) and every rank takes its numbers: one layout everywhere."""
    import torch.distributed as dist

    box = [measure(config) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _assemble(
    config: Config,
    layout: Layout,
    ds: dict[str, Any],
    factory: OptimizerFactory | None,
    lr_scheduler: Any,
    calibration: Calibration | None = None,
) -> Pipeline:
    """Steps 3-9 of the module docstring; the order is part of the contract (weights, RNG streams)."""
    import deepspeed
    import torch.distributed as dist

    topology = build_topology(config)
    tp = tensor_parallel.setup(config, topology)  # T > 1: megatron-core's groups, checked against the topology
    if config.engine_kind == "plain":  # ZeRO 2/3 at P = 1: DeepSpeed's plain engine
        engine, model, optimizer = plain_engine.assemble(config, layout, ds, topology, tp, factory, lr_scheduler)
    else:
        chunks = layout.virtual_stages > 1  # interleaved: v model chunks per rank
        if config.model.is_moe:  # every rank makes DeepSpeed's expert groups, from our topology
            data_first = bool(ds.get("use_data_before_expert_parallelism", False))
            moe_pipeline.create_expert_groups(topology, config.parallel.expert_parallel_size, data_first)
        model = (ChunkedGPTModelPipe if chunks else GPTModelPipe)(config, layout, topology=topology, tp=tp)
        moe_groups = config.optimizer.create_moe_param_group  # set for MoE models only (`Config._check_experts`)
        expert_group = f"ep_size_{config.parallel.expert_parallel_size}" if moe_groups else None
        add_group_placeholders(model, decoupled=config.optimizer.decoupled_lr is not None, expert_group=expert_group)
        optimizer = build_optimizer(model, config.optimizer, factory, config.training.cpu_optimizer)
        check_structure(model, optimizer)
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds, lr_scheduler=lr_scheduler
        )
    if config.model.is_moe and config.model.moe_router == "megatron":  # experts by global index: groups exist now
        moe.draw_experts_apart(engine.module)
        refresh_fp32_copies(engine.optimizer)  # ZeRO's and bf16's fp32 copies were taken from DeepSpeed's copies
    schedule = pipeline_schedules.find(config.parallel.pipeline_schedule, config.parallel.virtual_stages)
    if config.engine_kind == "pipeline":
        engine = _schedule_engine(engine, schedule)
        if config.model.is_moe:
            moe_pipeline.install_loss_report(engine)
    install_fp32_grad_norm(engine)
    install_mixed_precision_expert_norm(engine)
    activation_checkpointing.configure(config, layout, engine, tp)  # deepspeed.checkpointing's options, per rank
    rng.install_micro_batch_seeding(
        engine, lambda m: pipeline_schedules.forward_micro_batches(schedule, m, engine.num_stages, engine.stage_id)
    )
    timers = stage_timers.install(engine, config.parallel.pipeline_schedule, config.parallel.virtual_stages)
    watchdog = Watchdog(config.parallel.distributed_timeout_minutes * 60, dist.get_rank(), engine.stage_id)
    return Pipeline(
        engine=engine,
        model=model,
        optimizer=optimizer,
        ds_config=ds,
        layout=layout,
        watchdog=watchdog,
        timers=timers,
        calibration=calibration,
    )


def _schedule_engine(engine: Any, schedule: pipeline_schedules.PipelineSchedule) -> Any:
    """DeepSpeed's pipeline engine made to run `schedule` (1F1B: as it is)."""
    if schedule.virtual:
        return interleaved.adopt(engine)
    if schedule.splits_backward:
        return zero_bubble.adopt(engine)
    return engine


def _check_sizes(config: Config, layout: Layout | None) -> None:
    """The layout's stage count (when built already) and the world size agree with `config.parallel`
    (before any collective)."""
    par = config.parallel
    p, t, d = par.pipeline_model_parallel_size, par.tensor_model_parallel_size, par.data_parallel_size
    n = par.ds_sequence_parallel_size
    v = par.virtual_stages
    if layout is not None and (layout.num_ranks, layout.virtual_stages) != (p, v):
        chunks = f" ({layout.virtual_stages} per rank)" if layout.virtual_stages > 1 else ""
        wanted = f" with {v} virtual stages per rank" if v > 1 else ""
        raise ConfigError(
            f"layout {layout.to_string()} has {layout.num_stages} stages{chunks} but "
            f"config.parallel.pipeline_model_parallel_size is {p}{wanted}; pass layout=None to build it from the "
            f"config, or a layout with {p * v} stages"
        )
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else env_world_size()
    if p * t * d * n != world:
        fix = (
            f"set config.parallel.data_parallel_size to {world // (p * t * n)}"
            if world % (p * t * n) == 0
            else f"launch a multiple of {p * t * n} processes (torchrun --nproc_per_node, or deepspeed)"
        )
        ulysses = f" x --ds-sequence-parallel-size {n}" if n > 1 else ""
        raise ConfigError(
            f"--pipeline-model-parallel-size {p} x --tensor-model-parallel-size {t}{ulysses} x data parallel {d} "
            f"(config.parallel) = {p * t * d * n} ranks but the world size is {world}; {fix}"
        )
