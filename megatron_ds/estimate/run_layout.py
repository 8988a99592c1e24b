"""The layout a config asks for, with the costs its partition method balances. Pure: no torch.

`build_run_layout(config, machine)` turns the layout options of `config.parallel` into a `Layout`,
with the costs its partition method's registry entry `needs` (`layout_costs.method_costs`): the
memory model's inputs for this run, the memory limit (`--pp-memory-limit`, default the device's
memory) and, for `profile`, the stage times of a `Calibration` the runtime measured
(`megatron_ds.training.measure.calibrate`). The facts about the device come in as a `Machine`
(`megatron_ds.training.machine.probe` reads them). `layout_report` is what `--print-layout` and
the trainer print under the stage table.
"""

from __future__ import annotations

from megatron_ds.config import Config
from megatron_ds.errors import LayoutError
from megatron_ds.estimate.fit_advice import fit_advice
from megatron_ds.estimate.layout_costs import (
    compute_inputs,
    flop_stage_time,
    format_memory_table,
    format_time_table,
    method_costs,
)
from megatron_ds.estimate.machine import Machine
from megatron_ds.estimate.measured_time import Calibration, stage_time_fn
from megatron_ds.estimate.memory_inputs import MemoryInputs
from megatron_ds.estimate.memory_model import stage_memory
from megatron_ds.model.naming import gpt_spec_groups
from megatron_ds.pipeline import methods
from megatron_ds.pipeline.costs import StageTime, StageTimeFn
from megatron_ds.pipeline.fastest import NoFitError
from megatron_ds.pipeline.layout import Layout, MegatronLMFlags, build_layout, requested_method
from megatron_ds.pipeline.methods import PartitionMethod


def memory_inputs(config: Config, machine: Machine) -> MemoryInputs:
    """The memory model's inputs for this run (what a method that needs stage memory balances)."""
    t, par = config.training, config.parallel
    return MemoryInputs(
        model=config.model,
        regularization=config.regularization,
        micro_batch_size=t.micro_batch_size,
        num_micro_batches=config.grad_accumulation_steps,
        precision=t.precision,
        zero_stage=t.zero_stage,
        data_parallel_size=par.data_parallel_size * par.ds_sequence_parallel_size,  # the ZeRO group
        tensor_parallel_size=par.tensor_model_parallel_size,
        checkpoint_activations=t.checkpoint_activations,
        checkpoint_num_layers=t.checkpoint_num_layers,
        selective_recompute=t.selective_recompute,
        partition_activations=t.partition_activations,
        checkpoint_in_cpu=t.checkpoint_in_cpu and machine.device != "cpu",  # on a CPU they stay where they are
        sequence_parallel=par.sequence_parallel,
        ulysses_size=par.ds_sequence_parallel_size,
        expert_parallel_size=par.expert_parallel_size,
        engine=config.engine_kind,
        optimizer=config.optimizer.optimizer,
        offload_optimizer=t.optimizer_offload,
        offload_param=t.offload_param,
        device=machine.device,
        schedule=par.pipeline_schedule,
        virtual_stages=par.virtual_stages,
        document_ids=config.data.reset_position_ids or config.data.reset_attention_mask,
        document_mask=config.data.reset_attention_mask,
    )


def memory_limit(config: Config, method: str, machine: Machine) -> float:
    """`--pp-memory-limit` in bytes; without it the device's total memory; on CPU a LayoutError."""
    given = config.parallel.memory_limit_bytes
    if given is not None:
        return given
    if machine.device_memory is not None:
        return machine.device_memory
    raise LayoutError(
        f"--pp-partition-method {method} needs --pp-memory-limit on CPU (there is no device memory to default "
        f"to); give what each rank may hold, e.g. --pp-memory-limit 8GiB"
    )


def megatron_lm_flags(config: Config) -> MegatronLMFlags:
    """Megatron-LM's layout flags of this run, as `build_layout` takes them."""
    par = config.parallel
    return MegatronLMFlags(
        layout=par.pipeline_model_parallel_layout,
        first_stage_layers=par.decoder_first_pipeline_num_layers,
        last_stage_layers=par.decoder_last_pipeline_num_layers,
        account_for_embedding=par.account_for_embedding_in_pipeline_split,
        account_for_loss=par.account_for_loss_in_pipeline_split,
    )


def run_method(config: Config) -> PartitionMethod | None:
    """The registry entry this run's layout options use (None: dedicated stages, a layout string or
    Megatron-LM's split flags)."""
    par = config.parallel
    method = requested_method(
        par.pp_dedicated_embedding_stages, par.pp_layout, par.pp_partition_method, megatron_lm_flags(config)
    )
    return None if method is None else methods.find(method)


def uses_memory_model(config: Config) -> bool:
    """Whether the layout comes from the memory model (then `--print-layout` shows its prediction)."""
    entry = run_method(config)
    return entry is not None and entry.needs_stage_memory


def uses_measured_times(config: Config) -> bool:
    """Whether the layout depends on timing this machine (`profile`): ranks must agree on the numbers."""
    entry = run_method(config)
    return entry is not None and methods.MEASURED_STAGE_TIME in entry.needs


def needs_machine(config: Config) -> bool:
    """Whether the layout depends on the device (its kernels' memory, its memory as the limit)."""
    entry = run_method(config)
    return entry is not None and (entry.needs_stage_memory or methods.MEMORY_LIMIT in entry.needs)


def measured_stage_time(config: Config, calibration: Calibration, machine: Machine) -> StageTimeFn:
    """Stage times in seconds from a measurement of this run's groups."""
    inputs = compute_inputs(memory_inputs(config, machine))
    return stage_time_fn(calibration, inputs, config.parallel.pipeline_model_parallel_size)


def check_layout(config: Config, machine: Machine | None) -> None:
    """The parse-time check: build the layout without measuring anything (`profile` is checked
    with the compute model's times standing in for the measured ones: the same options, the same
    memory limit). Without a `machine`, layouts that depend on the device are left to the caller
    that knows it (`pretrain_gpt.py` passes one; `build_pipeline` resolves the layout itself)."""
    if machine is None and needs_machine(config):
        return
    build_run_layout(config, machine or Machine())


def build_run_layout(config: Config, machine: Machine, calibration: Calibration | None = None) -> Layout:
    """The layout this run uses on `machine` (raises LayoutError, a ValueError, on impossible options).

    `calibration`: for `profile`, the measured group times (the builder passes rank 0's to every
    rank); without one, the compute model's times stand in (a check of the options, not the run's
    layout)."""
    par = config.parallel
    entry = run_method(config)
    if entry is not None and entry.needs_stage_memory and config.model.vocab_size == 0:
        raise LayoutError(
            f"--pp-partition-method {entry.name} needs the vocabulary size: give --vocab-size or a tokenizer"
        )
    if par.pp_memory_limit is not None and (entry is None or methods.MEMORY_LIMIT not in entry.needs):
        using = [m.name for m in methods.REGISTRY.values() if methods.MEMORY_LIMIT in m.needs]
        raise LayoutError(
            f"--pp-memory-limit {par.pp_memory_limit} applies to --pp-partition-method {' or '.join(using)} only; "
            f"drop it or choose one of those methods"
        )
    p = par.pipeline_model_parallel_size
    costs = method_costs(
        entry,
        config.model,
        p,
        lambda: memory_inputs(config, machine),
        memory_limit=lambda: memory_limit(config, entry.name, machine),
        measured_time=lambda: _stage_time(config, calibration, machine),
    )
    try:
        return build_layout(
            gpt_spec_groups(config.model),
            p,
            dedicated=par.pp_dedicated_embedding_stages,
            layout=par.pp_layout,
            partition_method=par.pp_partition_method,
            costs=costs,
            megatron=megatron_lm_flags(config),
            virtual_stages=par.virtual_stages,
        )
    except NoFitError as e:
        raise LayoutError(f"{e}; {fit_advice(memory_inputs(config, machine), p, e.limit)}") from None


def _stage_time(config: Config, calibration: Calibration | None, machine: Machine) -> StageTimeFn:
    if calibration is not None:
        return measured_stage_time(config, calibration, machine)
    return flop_stage_time(memory_inputs(config, machine), config.parallel.pipeline_model_parallel_size)


def layout_report(config: Config, layout: Layout, machine: Machine, calibration: Calibration | None = None) -> str:
    """What to print under the stage table: nothing for layouts that need no model, the predicted
    memory per stage for those that balance memory, and time and memory per stage with the
    simulated step for `fastest` / `profile`."""
    entry = run_method(config)
    if entry is None or not entry.needs_stage_memory:
        return ""
    mem = memory_inputs(config, machine)
    stages = stage_memory(mem, layout)
    parts = [format_memory_table(stages)]
    if entry.needs_stage_time:
        p = layout.num_stages
        if methods.MEASURED_STAGE_TIME in entry.needs and calibration is not None:
            seconds = measured_stage_time(config, calibration, machine)
            times = [seconds(s, k) for s, k in enumerate(layout.layers_per_stage)]
            times = [StageTime(1e3 * t.forward, 1e3 * t.backward, 1e3 * t.optimizer) for t in times]
            unit, source = "ms", "measured once in this process, `profile`"
        else:
            flops = flop_stage_time(mem, p)
            times = [flops(s, k) for s, k in enumerate(layout.layers_per_stage)]
            unit, source = "GFLOP", "compute model, `fastest`; optimizer not counted"
        limit = memory_limit(config, entry.name, machine)
        parts.append(format_time_table(times, stages, mem.num_micro_batches, unit, source, limit, mem.schedule))
    return "\n".join(parts)
