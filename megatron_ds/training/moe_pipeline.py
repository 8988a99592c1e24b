"""A mixture-of-experts model on DeepSpeed's pipeline engine (P > 1): what the builder adds for it.

* `create_expert_groups`: DeepSpeed's expert-parallel and expert-data-parallel groups, made on every rank before the
  engine is built, and checked against our topology. DeepSpeed's engine makes them while it configures a MoE
  layer, so only on the ranks whose stage holds one; torch's `new_group` is collective over the whole world, so a
  stage without experts (the embedding's, a dense layer's) would leave the others waiting. Made here, each stage's
  data-parallel ranks are shared out as at P = 1: E consecutive ones hold the experts of one group (or, with the
  DeepSpeed JSON's `use_data_before_expert_parallelism`, every (D / E)-th one);
* `install_loss_report`: `train_batch` returns the step's lm loss and keeps its `moe loss` in `step_losses`, as
  the plain engine does at P = 1. DeepSpeed's pipeline engine returns the mean of the micro-batches' whole losses
  (lm + moe) and averages the additional losses the model reports (`GPTModelPipe.get_additional_losses`) over the
  micro-batches and the data-parallel ranks: that mean is the `moe loss` here, as the plain engine's at P = 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from deepspeed.runtime.pipe.topology import ProcessTopology


def expert_group_ranks(
    topology: ProcessTopology, expert_parallel_size: int, data_before_expert_parallel: bool
) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups) as global ranks: each stage's (and tensor rank's)
    data-parallel ranks split into groups of E that share out the experts, and the ranks that hold the same
    experts."""
    ep = expert_parallel_size
    expert, expert_data = [], []
    for pipe in range(topology.get_dim("pipe")):
        for model in range(topology.get_dim("model")):
            dp = [topology.get_rank(pipe=pipe, data=d, model=model) for d in range(topology.get_dim("data"))]
            stride = len(dp) // ep
            if data_before_expert_parallel:
                expert += [dp[i::stride] for i in range(stride)]
                expert_data += [dp[i * stride : (i + 1) * stride] for i in range(ep)]
            else:
                expert += [dp[i : i + ep] for i in range(0, len(dp), ep)]
                expert_data += [dp[i::ep] for i in range(ep)]
    return expert, expert_data


def create_expert_groups(
    topology: ProcessTopology, expert_parallel_size: int, data_before_expert_parallel: bool
) -> None:
    """DeepSpeed's groups of `expert_parallel_size` (named `ep_size_E`, which its MoE layers look up), made on every
    rank; an AssertionError if DeepSpeed's differ from `expert_group_ranks` (an internal invariant: our topology puts
    the pipeline outermost, as DeepSpeed's grouping assumes)."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    name = f"ep_size_{expert_parallel_size}"
    groups._create_expert_and_data_parallel(
        expert_parallel_size,
        pp_size=topology.get_dim("pipe"),
        use_data_before_expert_parallel_=data_before_expert_parallel,
    )
    rank = dist.get_rank()
    expert, expert_data = expert_group_ranks(topology, expert_parallel_size, data_before_expert_parallel)
    mine = [next(g for g in grouping if rank in g) for grouping in (expert, expert_data)]
    made = [
        list(groups._get_expert_parallel_group_ranks(name)),
        list(groups._get_expert_data_parallel_group_ranks(name)),
    ]
    assert made == mine, (rank, made, mine)


def install_loss_report(engine: Any) -> None:
    """`engine.train_batch` returns the lm loss and sets `engine.step_losses` {"moe loss": ...} (see the module)."""
    train_batch = engine.train_batch

    def reported(data_iter: Iterator[Any] | None = None, **kwargs: Any) -> torch.Tensor:
        train_batch(data_iter=data_iter, **kwargs)
        means = engine.agg_additional_losses  # every rank: broadcast from the last stage
        engine.step_losses = {"moe loss": means["moe loss"]}
        return means["lm loss"]

    engine.step_losses = {}
    engine.train_batch = reported
