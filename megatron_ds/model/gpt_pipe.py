"""GPT as DeepSpeed pipeline layer specs, in three named groups, and `GPTModelPipe`.

    pre  : cast_token_ids, WordEmbedding (tied), PositionEmbedding (+ dropout)
    body : TransformerLayer x N
    post : FinalNorm, WordEmbedding.lm_head_logits (tied) or LMHead, logits_to_fp32
    loss : cross_entropy_loss

Stage boundaries come from `megatron_ds.pipeline.layout`, never from DeepSpeed's partitioner.
"""
from __future__ import annotations

from typing import Any, Callable, Union

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, ProcessTopology

from megatron_ds.config import Config, ModelConfig
from megatron_ds.model import naming
from megatron_ds.model.init import spec_seed
from megatron_ds.model.layers import (
    FinalNorm,
    LMHead,
    PositionEmbedding,
    WordEmbedding,
    cast_token_ids,
    cross_entropy_loss,
    lm_head_logits,
    logits_to_fp32,
)
from megatron_ds.model.transformer import TransformerLayer
from megatron_ds.pipeline.layout import Layout

Spec = Union[LayerSpec, Callable[..., Any]]


def spec_name(spec: Spec) -> str:
    """The printable name of a spec: class name, function name, or `Class.forward_fn`."""
    if isinstance(spec, TiedLayerSpec) and spec.forward_fn is not None:
        return f"{spec.typename.__name__}.{spec.forward_fn.__name__}"
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    return spec.__name__


def build_layer_specs(model: ModelConfig, seed: int) -> list[Spec]:
    """The full spec list (the same for every layout; only the stage boundaries move)."""
    groups = naming.gpt_spec_groups(model)
    embedding_idx = groups.pre.index(naming.WORD_EMBEDDING)
    tied_seed = spec_seed(seed, embedding_idx)  # both tied copies start from the same draw

    def seeded(idx: int) -> int:
        return spec_seed(seed, idx)

    pre: list[Spec] = [
        cast_token_ids,
        TiedLayerSpec(naming.TIED_EMBEDDING_KEY, WordEmbedding, model, tied_seed),
        LayerSpec(PositionEmbedding, model, seeded(2)),
    ]
    first_layer = len(pre)
    body: list[Spec] = [LayerSpec(TransformerLayer, model, seeded(first_layer + i)) for i in range(model.num_layers)]
    first_post = first_layer + model.num_layers
    if model.untie_embeddings_and_output_weights:
        head: Spec = LayerSpec(LMHead, model, seeded(first_post + 1))
    else:
        head = TiedLayerSpec(naming.TIED_EMBEDDING_KEY, WordEmbedding, model, tied_seed, forward_fn=lm_head_logits)
    post: list[Spec] = [LayerSpec(FinalNorm, model, seeded(first_post)), head, logits_to_fp32]
    specs = pre + body + post
    assert [spec_name(s) for s in specs] == groups.names, ([spec_name(s) for s in specs], groups.names)
    return specs


def build_topology(config: Config) -> ProcessTopology:
    """DeepSpeed's topology: tensor innermost, then data, then pipeline (as megatron-core)."""
    par = config.parallel
    return PipeModelDataParallelTopology(num_pp=par.pipeline_model_parallel_size,
                                         num_mp=par.tensor_model_parallel_size,
                                         num_dp=par.data_parallel_size)


class GPTModelPipe(PipelineModule):
    """A GPT whose stage boundaries are `layout.parts`; needs torch.distributed initialised."""

    def __init__(self, config: Config, layout: Layout, topology: ProcessTopology | None = None,
                 mark_norms: bool = True) -> None:
        assert layout.num_stages == config.parallel.pipeline_model_parallel_size, layout
        self._layout = layout
        train = config.training
        super().__init__(
            layers=build_layer_specs(config.model, train.seed),
            topology=topology or build_topology(config),
            loss_fn=cross_entropy_loss,
            partition_method="megatron_ds.layout",
            activation_checkpoint_interval=train.checkpoint_num_layers if train.checkpoint_activations else 0,
        )
        if mark_norms:  # False only to demonstrate DeepSpeed's stage-0-only norm in tests
            mark_norm_counting(self)

    def _partition_layers(self, method: str = "megatron_ds.layout") -> None:
        del method  # boundaries come from the layout engine
        self.parts = self._layout.parts
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    def _is_checkpointable(self, funcs: list[Any]) -> bool:
        # Recompute transformer layers only: the embedding's input does not require grad.
        return all(isinstance(f, TransformerLayer) for f in funcs)

    @property
    def layout(self) -> Layout:
        return self._layout


def mark_norm_counting(module: torch.nn.Module) -> None:
    """Mark the parameters this rank counts in the global gradient norm.

    Every gradient element must be counted on exactly one rank of the model-parallel group
    (all stages x tensor ranks): a tied copy that DeepSpeed flags `ds_pipe_replicated` is left to
    its first stage, a tensor-replicated parameter to tensor rank 0. DeepSpeed's norm code counts
    a parameter when `is_model_parallel_parameter(p)` or its model-parallel rank is 0; without
    this marking its no-ZeRO pipeline path counts stage 0's parameters only.
    """
    from deepspeed.runtime.utils import is_model_parallel_parameter

    from megatron_ds.model.parallel import tensor_parallel_rank

    tp_rank = tensor_parallel_rank()
    for p in module.parameters():
        replicated_copy = getattr(p, "ds_pipe_replicated", False)
        sharded = is_model_parallel_parameter(p)
        p.model_parallel = (not replicated_copy) and (sharded or tp_rank == 0)
