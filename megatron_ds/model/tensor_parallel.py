"""Tensor parallelism as the model builder sees it, without importing megatron-core at T=1.

`TensorParallel` describes this rank's tensor-parallel group and is passed explicitly to every
layer spec. `setup` creates it: at T=1 a plain description (megatron-core is not imported: it is
slow to import); at T > 1 `megatron_ds.model.tensor_parallel_layers.setup` initialises megatron-core's
groups and checks them against DeepSpeed's topology. The linear-layer factories return torch's
`nn.Linear` at T=1 (`weight_grad.Linear`, whose weight gradient ZB-H1 may defer) and megatron-core's
parallel layers otherwise.

Under sequence parallelism (`TensorParallel.sequence_parallel`) the norms and the row-parallel
biases see only this rank's part of the sequence, so their gradients are partial sums:
`reduce_partial_gradients` sums them over the tensor group (Megatron's `sequence_parallel`
parameter attribute; Megatron-DeepSpeed #170). The query and key norms of `--qk-layernorm` see only
this rank's heads at any T > 1, so theirs are partial sums with or without sequence parallelism.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_ds.config import Config
from megatron_ds.distributed import forget_megatron_core_groups
from megatron_ds.model import weight_grad
from megatron_ds.model.tensor_parallel_rank import NO_TENSOR_PARALLEL, TensorParallel

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.topology import ProcessTopology


def setup(config: Config, topology: ProcessTopology) -> TensorParallel:
    """Tensor-parallel groups for this run (call after torch.distributed, before the model)."""
    if config.parallel.tensor_model_parallel_size == 1:
        forget_megatron_core_groups()  # a T>1 model built earlier in this process must not leak its groups
        return NO_TENSOR_PARALLEL
    from megatron_ds.model import tensor_parallel_layers

    return tensor_parallel_layers.setup(config, topology)


PARTIAL_GRADIENT = "sequence_parallel"
"""megatron-core's parameter attribute (set on a row-parallel bias under sequence parallelism, and by us
on the norms): the parameter is replicated over tensor ranks but each rank's gradient covers only its
part of the sequence (or, for the query and key norms, its heads)."""


def mark_partial_gradient(module: nn.Module) -> nn.Module:
    """Mark every parameter of `module` (a norm under sequence parallelism, a query/key norm at T > 1) with
    `PARTIAL_GRADIENT`."""
    for p in module.parameters():
        setattr(p, PARTIAL_GRADIENT, True)
    return module


def reduce_partial_gradients(module: nn.Module, tp: TensorParallel) -> int:
    """Sum each `PARTIAL_GRADIENT` parameter's gradient over the tensor group as autograd produces it, before
    DeepSpeed accumulates it (so every engine, ZeRO stage and precision sees the full gradient); returns how
    many parameters it hooked. One small all-reduce per parameter per micro-batch (Megatron sums the
    accumulated gradients once per step, coalesced); every tensor rank runs the same backward, so the
    collectives come in the same order on each."""
    if tp.size == 1:
        return 0
    import torch.distributed as dist

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()  # a hook must not change the gradient it is given
        dist.all_reduce(grad, group=tp.group)
        return grad

    hooked = [p for p in module.parameters() if getattr(p, PARTIAL_GRADIENT, False)]
    for p in hooked:
        p.register_hook(summed)
    return len(hooked)


def column_linear(
    tp: TensorParallel, full_weight: torch.Tensor, bias: bool = True, fused_rows: tuple[int, ...] | None = None
) -> nn.Module:
    """x (.., in) -> this rank's output features (.., out / T), from the full (out, in) weight.

    `fused_rows`: the rows are these fused parts (q, k, v of a QKV; gate, up of a SwiGLU fc1);
    each rank keeps its block of every part (`megatron_ds.model.init.shard_fused`). Biases start
    at zero.
    """
    if tp.size == 1:
        return _linear(full_weight, bias)
    from megatron_ds.model.tensor_parallel_layers import ColumnLinear

    return ColumnLinear(tp, full_weight, bias=bias, fused_rows=fused_rows)


def row_linear(tp: TensorParallel, full_weight: torch.Tensor, bias: bool = True) -> nn.Module:
    """This rank's input features (.., in / T) -> the full output (.., out), summed over ranks."""
    if tp.size == 1:
        return _linear(full_weight, bias)
    from megatron_ds.model.tensor_parallel_layers import RowLinear

    return RowLinear(tp, full_weight, bias=bias)


@torch.no_grad()
def _linear(full_weight: torch.Tensor, bias: bool) -> nn.Linear:
    out_features, in_features = full_weight.shape
    linear = weight_grad.Linear(in_features, out_features, bias=bias)
    linear.weight.copy_(full_weight)
    if bias:
        linear.bias.zero_()
    return linear
