"""The layout a config asks for, with the costs its partition method balances.

`build_run_layout(config)` turns the layout options of `config.parallel` into a `Layout`: the
pure layout engine (`megatron_ds.pipeline`) receives the per-spec parameter counts or the memory
model's inputs from here, so it needs nothing from the model or the estimates itself.
"""

from __future__ import annotations

import torch

from megatron_ds.config import Config
from megatron_ds.errors import LayoutError
from megatron_ds.pipeline.layout import Layout


def memory_inputs(config: Config):
    """The memory model's inputs for this run (what `--pp-partition-method memory` balances)."""
    from megatron_ds.estimate.memory_model import MemoryInputs

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


def uses_memory_model(config: Config) -> bool:
    par = config.parallel
    return par.pp_partition_method == "memory" or (par.pp_layout or "").strip().lower() == "auto"


def build_run_layout(config: Config) -> Layout:
    """The layout this run uses (raises LayoutError, a ValueError, on impossible options)."""
    from megatron_ds.model.naming import gpt_spec_groups, gpt_spec_param_counts
    from megatron_ds.pipeline.layout import build_layout

    par = config.parallel
    weights = None
    if par.pp_partition_method == "parameters":
        weights = gpt_spec_param_counts(config.model)
    mem = None
    if uses_memory_model(config):
        if config.model.vocab_size == 0:
            raise LayoutError(
                "--pp-partition-method memory needs the vocabulary size: give --vocab-size or a tokenizer"
            )
        mem = memory_inputs(config)
    return build_layout(
        gpt_spec_groups(config.model),
        par.pipeline_model_parallel_size,
        dedicated=par.pp_dedicated_embedding_stages,
        layout=par.pp_layout,
        partition_method=par.pp_partition_method,
        spec_weights=weights,
        memory_inputs=mem,
    )


def predicted_memory_table(config: Config, layout: Layout) -> str:
    """Predicted memory per stage (the memory model), printed under the layout."""
    from megatron_ds.estimate.memory_model import stage_memory
    from megatron_ds.pipeline.balance import format_memory_table

    return format_memory_table(stage_memory(memory_inputs(config), layout))
