"""Build the pipeline model, its optimizer and the DeepSpeed engine, in that order."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_ds.config import Config
from megatron_ds.model.gpt_pipe import GPTModelPipe
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


def build_engine(config: Config, layout: Layout, lr_scheduler: Optional[Any] = None, preflight: bool = True,
                 fixes: bool = True) -> EngineBundle:
    """GPTModelPipe -> same-structure optimizer groups -> preflight -> DeepSpeed engine.

    `fixes=False` leaves out the two structural fixes (norm marking, group placeholders) so
    tests can show the defects they fix; never use it for training.
    """
    import deepspeed

    ds_config = deepspeed_config.build(config)
    model = GPTModelPipe(config, layout, mark_norms=fixes)
    if fixes:
        add_group_placeholders(model)
    optimizer = build_optimizer(model, config.optimizer)
    if preflight:
        from megatron_ds.training.preflight import check_structure

        check_structure(model, optimizer, config)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                                   lr_scheduler=lr_scheduler)
    _record_fp32_grad_norm(engine)
    return EngineBundle(engine=engine, model=model, optimizer=optimizer, ds_config=ds_config)


def _record_fp32_grad_norm(engine: Any) -> None:
    """Keep the norm DeepSpeed's fp32 clipping computes, so it can be logged like the others.

    On the no-ZeRO fp32 path DeepSpeed computes the global norm in `clip_fp32_gradients` (made
    correct across stages by `mark_norm_counting`) and throws it away; this instance-level
    wrapper stores it where the ZeRO and bf16 paths store theirs.
    """
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_fp32_gradients() -> None:
        engine._global_grad_norm = clip_grad_norm_(parameters=engine.module.parameters(),
                                                   max_norm=engine.gradient_clipping(), mpu=engine.mpu)

    engine.clip_fp32_gradients = clip_fp32_gradients


def grad_norm(engine: Any) -> Optional[float]:
    """The last step's global gradient norm, or None when this path does not compute one."""
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if isinstance(norm, torch.Tensor) else norm)
