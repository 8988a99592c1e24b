"""The layout a config asks for, with the costs its partition method balances.

`build_run_layout(config)` turns the layout options of `config.parallel` into a `Layout`, with
the costs its partition method's registry entry `needs` (`layout_costs.method_costs`).
"""

from __future__ import annotations

import torch

from megatron_ds.config import Config
from megatron_ds.errors import LayoutError
from megatron_ds.estimate.layout_costs import format_memory_table, method_costs
from megatron_ds.estimate.memory_model import MemoryInputs, stage_memory
from megatron_ds.model.naming import gpt_spec_groups
from megatron_ds.pipeline import methods
from megatron_ds.pipeline.layout import Layout, MegatronLMFlags, build_layout, requested_method
from megatron_ds.pipeline.methods import PartitionMethod


def memory_inputs(config: Config) -> MemoryInputs:
    """The memory model's inputs for this run (what a method that needs stage memory balances)."""
    t, par = config.training, config.parallel
    return MemoryInputs(
        model=config.model,
        regularization=config.regularization,
        micro_batch_size=t.micro_batch_size,
        num_micro_batches=config.grad_accumulation_steps,
        precision=t.precision,
        zero_stage=t.zero_stage,
        data_parallel_size=par.data_parallel_size,
        tensor_parallel_size=par.tensor_model_parallel_size,
        checkpoint_activations=t.checkpoint_activations,
        checkpoint_num_layers=t.checkpoint_num_layers,
        optimizer=config.optimizer.optimizer,
        device="cuda" if torch.cuda.is_available() else "cpu",
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


def build_run_layout(config: Config) -> Layout:
    """The layout this run uses (raises LayoutError, a ValueError, on impossible options)."""
    par = config.parallel
    entry = run_method(config)
    if entry is not None and entry.needs_stage_memory and config.model.vocab_size == 0:
        raise LayoutError(
            f"--pp-partition-method {entry.name} needs the vocabulary size: give --vocab-size or a tokenizer"
        )
    p = par.pipeline_model_parallel_size
    return build_layout(
        gpt_spec_groups(config.model),
        p,
        dedicated=par.pp_dedicated_embedding_stages,
        layout=par.pp_layout,
        partition_method=par.pp_partition_method,
        costs=method_costs(entry, config.model, p, lambda: memory_inputs(config)),
        megatron=megatron_lm_flags(config),
    )


def predicted_memory_table(config: Config, layout: Layout) -> str:
    """Predicted memory per stage (the memory model), printed under the layout."""
    return format_memory_table(stage_memory(memory_inputs(config), layout))
