"""Build the pipeline model, its optimizer and the DeepSpeed engine, in that order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_ds.config import Config
from megatron_ds.model import parallel
from megatron_ds.model.gpt_pipe import COUNTED_IN_NORM, GPTModelPipe, build_topology
from megatron_ds.pipeline.layout import Layout
from megatron_ds.training import deepspeed_config
from megatron_ds.training.optimizer import add_group_placeholders, build_optimizer


@dataclass
class EngineBundle:
    """What training needs: the engine and the pieces it was built from."""

    engine: Any  # deepspeed.runtime.pipe.engine.PipelineEngine
    model: GPTModelPipe
    optimizer: torch.optim.Optimizer
    ds_config: dict[str, Any]


def build_engine(
    config: Config, layout: Layout, lr_scheduler: Any | None = None, preflight: bool = True, fixes: bool = True
) -> EngineBundle:
    """Tensor-parallel set-up -> GPTModelPipe -> same-structure optimizer groups -> preflight -> engine.

    `fixes=False` leaves out the structural fixes (norm marking and the norm that reads it,
    group placeholders) so tests can show the defects they fix; never use it for training.
    """
    import deepspeed

    ds_config = deepspeed_config.build(config)
    topology = build_topology(config)
    tp = parallel.setup(config, topology)  # T > 1: megatron-core's groups, checked against the topology
    model = GPTModelPipe(config, layout, topology=topology, mark_norms=fixes, tp=tp)
    if fixes:
        add_group_placeholders(model)
    optimizer = build_optimizer(model, config.optimizer)
    if preflight:
        from megatron_ds.training.preflight import check_structure

        check_structure(model, optimizer, config)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config, lr_scheduler=lr_scheduler
    )
    install_fp32_grad_norm(engine, counted_only=fixes)
    return EngineBundle(engine=engine, model=model, optimizer=optimizer, ds_config=ds_config)


def install_fp32_grad_norm(engine: Any, counted_only: bool = True) -> None:
    """Clip on the no-ZeRO fp32 path with the norm `mark_norm_counting` defines, and keep it.

    DeepSpeed's `clip_grad_norm_` there counts a parameter when the rank is first in its
    model-parallel group or the parameter is `model_parallel` or `tensor_model_parallel`; it
    ignores `ds_pipe_replicated`, so at T > 1 the last stage's tied embedding shard (which
    megatron-core marks `tensor_model_parallel`) would be counted twice. This instance-level
    replacement counts exactly the parameters marked `model_parallel`, and stores the norm where
    the ZeRO and bf16 paths store theirs (DeepSpeed's version throws it away).
    `counted_only=False` keeps DeepSpeed's rule (for the tests that show its defect).
    """
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_fp32_gradients() -> None:
        params = engine.module.parameters()
        max_norm = engine.gradient_clipping()
        if counted_only:
            engine._global_grad_norm = clip_counted_grad_norm_(params, max_norm, engine.mpu.get_model_parallel_group())
        else:
            engine._global_grad_norm = clip_grad_norm_(parameters=params, max_norm=max_norm, mpu=engine.mpu)

    engine.clip_fp32_gradients = clip_fp32_gradients


@torch.no_grad()
def clip_counted_grad_norm_(parameters: Any, max_norm: float, group: Any) -> torch.Tensor:
    """Global L2 norm over the gradients this rank counts (all-reduced over `group`: every stage
    and tensor rank of one data-parallel replica), then scale every gradient as DeepSpeed does."""
    import torch.distributed as dist

    params = [p for p in parameters if p.grad is not None]
    counted = [p.grad.detach().float().norm(2) for p in params if getattr(p, COUNTED_IN_NORM, False)]
    total = torch.stack(counted).pow(2).sum() if counted else torch.zeros(())
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.dtype))
    return norm


def grad_norm(engine: Any) -> float | None:
    """The last step's global gradient norm, or None when this path does not compute one."""
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if isinstance(norm, torch.Tensor) else norm)
