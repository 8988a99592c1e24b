"""The GPT of `gpt_pipe` as one plain `nn.Module`, for DeepSpeed's plain engine (ZeRO 2/3 at P = 1).

`GPTModel` builds the very spec list `build_layer_specs` gives the pipeline (same specs, same
seeded initialisation, the same tied word embedding, the same tensor parallelism) and registers the
modules under the names DeepSpeed's one-stage `PipelineModule` gives them (`tied_modules.word_embeddings`,
then one child per spec index: `3.qkv.weight`), so parameter order, optimizer groups, ZeRO partitions,
the norm marking and the layout-free names of `training/checkpoint/universal/names.py` are the
pipeline's at P = 1. Its forward runs the specs in order with DeepSpeed's activation checkpointing cut
exactly as `PipelineModule.forward` cuts it (chunks of `--checkpoint-num-layers` functions, recomputed
when every function of the chunk is a transformer layer).

Why not the `PipelineModule` itself: `deepspeed.initialize` builds the pipeline engine for any
`PipelineModule`, and DeepSpeed's plain engine switches to pipeline behaviour (no overlapped ZeRO
communication, pipeline gradient reduction) when it is handed one.

ZeRO-3 (`partition`): each spec is built whole, from its seeds, and partitioned over the data-parallel
group at once (`deepspeed.zero.Init(module=...)`), so a rank holds one spec's full weights at a time,
never the model's. Weights are read and written per spec in DeepSpeed's per-layer files
(`layer_XX-model_RR-model_states.pt`, as `PipelineModule.save_state_dict` names them), gathered under
`deepspeed.zero.GatheredParameters` when partitioned: checkpoints and their readers are the pipeline's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipelineParallelGrid, ProcessTopology
from torch import nn

from megatron_ds.config import Config
from megatron_ds.model import rng
from megatron_ds.model.gpt_pipe import build_layer_specs, build_topology, loss_function, mark_norm_counting
from megatron_ds.model.tensor_parallel import NO_TENSOR_PARALLEL, TensorParallel, reduce_partial_gradients
from megatron_ds.model.tensor_parallel_rank import NO_ULYSSES, UlyssesGroup
from megatron_ds.model.transformer import TransformerLayer
from megatron_ds.pipeline.layout import Layout

Partition = Callable[[nn.Module], None]
"""Partitions one freshly built spec's parameters (ZeRO-3), or None to keep them whole."""


def is_partitioned(p: torch.Tensor) -> bool:
    """A ZeRO-3 parameter (its data is this rank's partition; `ds_shape` is the full shape)."""
    return hasattr(p, "ds_id")


class GPTModel(nn.Module):
    """The whole GPT on one rank (per tensor rank at T > 1); needs torch.distributed initialised."""

    def __init__(
        self,
        config: Config,
        layout: Layout,
        topology: ProcessTopology | None = None,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        partition: Partition | None = None,
        grid: PipelineParallelGrid | None = None,
        ulysses: UlyssesGroup = NO_ULYSSES,
    ) -> None:
        super().__init__()
        assert layout.num_stages == 1 == config.parallel.pipeline_model_parallel_size, layout
        assert tp.size == config.parallel.tensor_model_parallel_size, (tp, config.parallel)
        train = config.training
        self._layout = layout
        self.tensor_parallel = tp
        self._topo = topology or build_topology(config)
        self._grid = grid or PipelineParallelGrid(topology=self._topo)
        self.global_rank = self._grid.get_global_rank()
        assert self._grid.get_slice_parallel_rank() == tp.rank, (self._grid.get_slice_parallel_rank(), tp)
        self.stage_id = 0
        self.ulysses = ulysses
        self.loss_fn = loss_function(tp, ulysses)
        self.activation_checkpoint_interval = train.checkpoint_num_layers if train.checkpoint_activations else 0
        rng.reset_streams()  # this model's dropout streams start from their seeds
        self.tied_modules = nn.ModuleDict()  # first, as PipelineModule registers it: the same parameter order
        self.forward_funcs: list[Callable[..., Any]] = []
        self.spec_modules: dict[int, nn.Module] = {}
        """The module whose state is stored in spec i's file (the tied embedding at its first index)."""
        specs = build_layer_specs(
            config.model,
            config.regularization,
            train.seed,
            tp,
            ulysses,
            train.selective_recompute,
            config.data.reset_attention_mask,
            config.parallel.expert_parallel_size,
        )
        for index, spec in enumerate(specs):
            self._add_spec(index, spec, partition or (lambda module: None))
        self.moe_loss_coeff = config.model.moe_loss_coeff
        self.moe_layers = [m for m in self.spec_modules.values() if getattr(m, "moe", None) is not None]
        """The transformer layers with experts (Megatron-DeepSpeed's MoE layers), in order."""
        mark_norm_counting(self, tp.rank)
        reduce_partial_gradients(self, tp)

    def _add_spec(self, index: int, spec: Any, partition: Partition) -> None:
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied_modules:
                module = spec.build()
                partition(module)
                self.tied_modules[spec.key] = module
                self.spec_modules[index] = module
            module = self.tied_modules[spec.key]
            self.forward_funcs.append(module if spec.forward_fn is None else partial(spec.forward_fn, module))
        elif isinstance(spec, LayerSpec):
            module = spec.build()
            partition(module)
            self.add_module(str(index), module)
            self.spec_modules[index] = module
            self.forward_funcs.append(module)
        else:
            self.forward_funcs.append(spec)

    @property
    def layout(self) -> Layout:
        return self._layout

    def mpu(self) -> PipelineParallelGrid:
        """DeepSpeed's grid of this topology: the data-parallel and model-parallel groups the engine uses."""
        return self._grid

    def forward(self, inputs: Any) -> torch.Tensor:
        """(tokens,) (or packed documents' (tokens, position_ids, document_ids)) -> fp32 logits (b, s, v/T); the loss is `loss_fn(logits, (labels, loss_mask))`."""
        interval = self.activation_checkpoint_interval
        funcs = self.forward_funcs
        if interval == 0:
            return _run(funcs)(inputs)
        from deepspeed.runtime.activation_checkpointing import checkpointing

        x = inputs
        for start in range(0, len(funcs), interval):
            chunk = funcs[start : start + interval]
            x = x if isinstance(x, tuple) else (x,)
            if all(isinstance(f, TransformerLayer) for f in chunk):
                x = _recomputed(chunk, x, checkpointing.checkpoint)
            else:
                x = _run(chunk)(*x)
        return x

    def moe_loss(self) -> torch.Tensor | None:
        """`--moe-loss-coeff` x the sum of the MoE layers' load-balancing losses of the last forward (pretrain_gpt.py's
        `forward_step`); None for a dense model."""
        if not self.moe_layers:
            return None
        return self.moe_loss_coeff * sum(layer.l_aux for layer in self.moe_layers)

    def layer_file(self, directory: str, index: int) -> str:
        """DeepSpeed's name of spec `index`'s weights on this tensor rank (as `PipelineModule.ckpt_layer_path`)."""
        repr_ = self._topo.get_rank_repr(rank=self.global_rank)
        return os.path.join(directory, f"layer_{index:02d}" + (f"-{repr_}" if repr_ else "") + "-model_states.pt")

    def save_state_dict(self, save_dir: str, checkpoint_engine: Any, exclude_frozen_params: bool = False) -> None:
        """Every spec's weights into its own file, written by data-parallel rank 0 (collective under ZeRO-3:
        each spec is gathered on every rank in turn)."""
        del exclude_frozen_params  # nothing is frozen
        writer = self._topo.get_coord(self.global_rank).data == 0  # under Ulysses, one rank of the DP x N
        if writer:
            checkpoint_engine.makedirs(save_dir, exist_ok=True)
        for index, module in self.spec_modules.items():
            with gathered(module):
                state = {k: v.detach().clone() for k, v in module.state_dict().items()} if writer else None
            if writer:
                checkpoint_engine.save(state_dict=state, path=self.layer_file(save_dir, index))

    def load_state_dir(self, load_dir: str, checkpoint_engine: Any = None, strict: bool = True) -> None:
        """Every spec's weights from its file of this tensor rank (written into the partitions under ZeRO-3)."""
        for index, module in self.spec_modules.items():
            path = self.layer_file(load_dir, index)
            state = torch.load(path, map_location="cpu", weights_only=True)
            with gathered(module, modify=True):
                module.load_state_dict(state, strict=strict)


def _run(funcs: list[Callable[..., Any]]) -> Callable[..., Any]:
    def run(*inputs: Any) -> Any:
        x = inputs[0] if len(inputs) == 1 else inputs
        for f in funcs:
            x = f(x)
        return x

    return run


def _recomputed(chunk: list[Any], x: tuple[Any, ...], checkpoint: Callable[..., Any]) -> Any:
    """`chunk`'s output on `x` by DeepSpeed's activation checkpointing (its forward under no_grad, recomputed in
    backward). The MoE layers' load-balancing losses leave the chunk as outputs of the checkpointed function, so they
    reach the loss with a gradient path (through the recomputation, to the gates), kept as each layer's `l_aux` as
    the forward without recomputation keeps them; the `l_aux` the no_grad forward leaves on a layer has none."""
    moe_layers = [f for f in chunk if f.moe is not None]
    if not moe_layers:
        return checkpoint(_run(chunk), *x)

    def run_with_losses(*inputs: Any) -> tuple[Any, ...]:
        out = _run(chunk)(*inputs)
        return (*(out if isinstance(out, tuple) else (out,)), *(layer.l_aux for layer in moe_layers))

    out = list(checkpoint(run_with_losses, *x))
    for layer, l_aux in zip(moe_layers, out[-len(moe_layers) :], strict=True):
        layer.l_aux = l_aux
    out = out[: -len(moe_layers)]
    return out[0] if len(out) == 1 else tuple(out)


def gathered(what: nn.Module | list[torch.Tensor], modify: bool = False) -> Any:
    """A context in which a module's (or these) full parameters are present: DeepSpeed's
    `GatheredParameters` for ZeRO-3 partitions (collective over the data-parallel group; `modify`: rank
    0's values are written back into every partition on exit), nothing otherwise."""
    params = [p for p in (what.parameters() if isinstance(what, nn.Module) else what) if is_partitioned(p)]
    if not params:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None)
