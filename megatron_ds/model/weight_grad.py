"""Linear layers whose weight gradient can wait: the input-gradient / weight-gradient split of ZB-H1.

Every linear layer of the model (the transformer's QKV, projection and MLP, the LM head, tied or
not, at any T: our `nn.Linear` form at T = 1, megatron-core's column and row parallel layers at
T > 1) runs through `linear`, one autograd function whose backward returns the input gradient
(all-reduced over the tensor-parallel group where megatron-core's column-parallel layer does so)
and the bias gradient, and either returns the weight gradient as usual or, inside
`WeightGradStore.deferring()`, stores (input, output gradient, weight) for a later weight pass.
Megatron-DeepSpeed's ZB-H1 does the same in megatron-core's linear (`WeightGradStore` of its PR
#396); the engine side is `training/zero_bubble.py`.

`WeightGradStore.run_oldest()` computes one backward's stored weight gradients, grad_output^T @ input
in the layer's dtype as megatron-core's linear does, and adds them to `weight.grad` in the order of
the backwards, so a schedule that runs the weight passes in backward order (exact semantics) gives
every weight the same gradient, summed in the same order, as 1F1B. Other parameters (norms,
embeddings, biases) get their gradients in the backward itself.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVE: WeightGradStore | None = None
"""The store of the backward running now (a global, not thread-local: on GPU autograd runs each
device's backward on its own thread)."""


class WeightGradStore:
    """Deferred weight gradients, one entry per backward run inside `deferring()`, oldest first."""

    def __init__(self) -> None:
        self._current: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._queue: deque[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = deque()
        self.deferred = 0
        """Weight gradients deferred so far (what tests read to see that the split happened)."""

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Store the weight gradients of the linear layers that the backward inside computes."""
        global _ACTIVE
        assert _ACTIVE is None, "a weight-gradient store is already deferring"
        _ACTIVE = self
        try:
            yield
        finally:
            _ACTIVE = None
            self._queue.append(self._current)
            self._current = []

    def add(self, inputs: torch.Tensor, grad_output: torch.Tensor, weight: torch.Tensor) -> None:
        self._current.append((inputs, grad_output, weight))
        self.deferred += 1

    @property
    def pending(self) -> int:
        """Backwards whose weight gradients still wait."""
        return len(self._queue)

    @torch.no_grad()
    def run_oldest(self) -> None:
        """The weight pass of the oldest stored backward: its gradients added into `weight.grad`."""
        assert self._queue, "a weight pass without a backward whose weight gradients wait"
        for inputs, grad_output, weight in self._queue.popleft():
            grad = weight_gradient(grad_output, inputs)
            if weight.grad is None:
                weight.grad = grad
            else:
                weight.grad.add_(grad)
            del grad  # the added copy is freed before the next one is made (measured: else two at once)

    def clear(self) -> None:
        """Forget everything stored (a step that failed half-way)."""
        self._current, self._queue = [], deque()


def weight_gradient(grad_output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """dL/dW = grad_output^T @ input over every token: (out, in) from (.., out) and (.., in)."""
    return grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(inputs.reshape(-1, inputs.shape[-1]))


def _gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The whole sequence from every rank's part (sequence-first, megatron-core's all-gather)."""
    from megatron.core.tensor_parallel.mappings import _gather_along_first_dim

    return _gather_along_first_dim(x, group)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Any, sequence_group: Any
    ) -> torch.Tensor:
        # Under sequence parallelism only this rank's part of the input is saved; the backward gathers it
        # again, as megatron-core's linear does.
        ctx.save_for_backward(x, weight)
        # The parameter itself, for its `.grad`: a saved-tensor hook (the memory meter's) may hand
        # the backward another tensor object for `weight`.
        ctx.parameter = weight
        ctx.has_bias, ctx.group, ctx.sequence_group = bias is not None, group, sequence_group
        return F.linear(x if sequence_group is None else _gather(x, sequence_group), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        whole = x if ctx.sequence_group is None else _gather(x, ctx.sequence_group)
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)  # (.., out) @ (out, in)
            if ctx.sequence_group is not None:  # each rank keeps its part of the summed gradient
                from megatron.core.tensor_parallel.mappings import _reduce_scatter_along_first_dim

                grad_input = _reduce_scatter_along_first_dim(grad_input, ctx.sequence_group)
            elif ctx.group is not None:  # megatron-core's column-parallel layer: sum over tensor ranks
                torch.distributed.all_reduce(grad_input, group=ctx.group)
        if ctx.needs_input_grad[1]:
            if _ACTIVE is not None:
                _ACTIVE.add(whole, grad_output, ctx.parameter)
            else:
                grad_weight = weight_gradient(grad_output, whole)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
        return grad_input, grad_weight, grad_bias, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    group: Any = None,
    sequence_group: Any = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) whose weight gradient a store may defer; `group`: all-reduce the
    input gradient over it (a column-parallel layer's tensor-parallel group); `sequence_group`: the
    input is this rank's part of the sequence (dim 0), all-gathered over the group for the product, and
    the input gradient reduce-scattered back (megatron-core's column-parallel linear under sequence
    parallelism). The deferred weight pass then keeps the gathered input."""
    return _Linear.apply(x, weight, bias, group, sequence_group)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state-dict keys) through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def megatron_linear(
    x: torch.Tensor, weight: torch.Tensor, fallback: Callable[..., torch.Tensor], **kwargs: Any
) -> torch.Tensor:
    """megatron-core's `_forward_impl` call through `linear`, where it means the same: its plain and its
    sequence-parallel linear, not gradient-accumulation fusion or deferred embedding gradients (those run
    megatron-core's own function, with the weight gradient in the backward)."""
    plain = not kwargs.get("gradient_accumulation_fusion")
    if not (plain and kwargs.get("grad_output_buffer") is None and weight.requires_grad):
        return fallback(x, weight, **kwargs)
    if kwargs.get("sequence_parallel"):
        return linear(x, weight, kwargs.get("bias"), sequence_group=kwargs.get("tp_group"))
    group = kwargs.get("tp_group") if kwargs.get("allreduce_dgrad") else None
    return linear(x, weight, kwargs.get("bias"), group)
