"""The aggregated load-balancing loss a mixture-of-experts model passes between pipeline stages.

On DeepSpeed's pipeline engine (P > 1) the loss is computed on the last stage, but the MoE layers' load-balancing
losses (`l_aux`) arise on the stages that hold them. As Megatron-DeepSpeed's GPTModelPipe (PR #373, bcedecd1), they
travel with the activation, summed on the way:

  * transformer layer 0 starts the aggregate (its own `l_aux`, or 0 on a dense layer), every later layer takes it and
    adds its own (a dense layer passes it on): the layers take and return `(activation, [ids,] aggregate)`, the
    aggregate a 0-dimensional fp32 tensor last in the tuple, after packed documents' ids (`model.documents`);
  * the final norm takes it off (`FinalNorm.aggregated_moe_loss`) and the loss adds `--moe-loss-coeff` x it to the
    micro-batch's lm loss (`gpt_pipe.GPTModelPipe`), as upstream's `_calculate_moe_loss` spec and `loss_func` do.

DeepSpeed sends every tensor of the tuple and the gradient of every floating-point one back, so each gate gets the
gradient of `coeff x l_aux` as in one process. The start is a leaf that requires grad: a stage of dense layers then
sends a tensor DeepSpeed can run backward through (it calls `backward` on every floating-point output).
"""

from __future__ import annotations

from typing import Any

import torch


def take(x: Any, carried: bool) -> tuple[Any, torch.Tensor | None]:
    """A layer's input -> (the input without the aggregate, the aggregate); `carried` False: (x, None)."""
    if not carried:
        return x, None
    assert isinstance(x, (tuple, list)) and len(x) >= 2, "a layer after the first takes (activation, ..., aggregate)"
    rest = tuple(x[:-1])
    return (rest[0] if len(rest) == 1 else rest), x[-1]


def give(out: Any, aggregate: torch.Tensor) -> tuple[Any, ...]:
    """What a layer passes on: its output with the aggregate last."""
    return (*(out if isinstance(out, tuple) else (out,)), aggregate)


def add(aggregate: torch.Tensor | None, l_aux: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The aggregate after a layer whose load-balancing loss is `l_aux` (None: a dense layer); `aggregate` None: the
    first layer starts it."""
    if aggregate is None:
        start = torch.zeros((), dtype=torch.float32, device=device, requires_grad=True)
        return start if l_aux is None else start + l_aux.float()
    return aggregate if l_aux is None else aggregate + l_aux.float()
