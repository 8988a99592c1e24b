"""The DeepSpeed engine's gradient norm: the counted fp32 clip, and reading the last step's norm."""

from __future__ import annotations

from typing import Any

import torch

from megatron_ds.model.gpt_pipe import COUNTED_IN_NORM


def install_fp32_grad_norm(engine: Any) -> None:
    """Clip on the no-ZeRO fp32 path with the norm `mark_norm_counting` defines, and keep it.

    DeepSpeed's `clip_grad_norm_` there counts a parameter when the rank is first in its
    model-parallel group or the parameter is `model_parallel` or `tensor_model_parallel`; it
    ignores `ds_pipe_replicated`, so at T > 1 the last stage's tied embedding shard (which
    megatron-core marks `tensor_model_parallel`) would be counted twice. This instance-level
    replacement counts exactly the parameters marked `model_parallel`, and stores the norm where
    the ZeRO and bf16 paths store theirs (DeepSpeed's version throws it away).

    Mixture-of-experts models: each expert's gradient is held by one rank of its expert-parallel group, so
    the experts' squares are summed over that group too, which gives the norm of the one-process run.
    (DeepSpeed's `clip_grad_norm_` instead averages each rank's own norm over the data-parallel ranks, a
    different number once the ranks hold different experts: `megatron_ds.flags.to_config` prints a NOTICE.)
    """

    def clip_fp32_gradients() -> None:
        params = engine.module.parameters()
        group = engine.mpu.get_model_parallel_group()
        engine._global_grad_norm = clip_counted_grad_norm_(
            params, engine.gradient_clipping(), group, expert_parallel_group(engine)
        )

    engine.clip_fp32_gradients = clip_fp32_gradients


def expert_parallel_group(engine: Any) -> Any:
    """The expert-parallel process group of a mixture-of-experts model (every MoE layer uses the one size), or None."""
    groups = {id(g): g for g in (getattr(m, "ep_group", None) for m in engine.module.modules()) if g is not None}
    assert len(groups) <= 1, len(groups)
    return next(iter(groups.values()), None)


@torch.no_grad()
def clip_counted_grad_norm_(parameters: Any, max_norm: float, group: Any, expert_group: Any = None) -> torch.Tensor:
    """Global L2 norm over the gradients this rank counts (all-reduced over `group`: every stage
    and tensor rank of one data-parallel replica; the experts' over `expert_group` too), then scale
    every gradient as DeepSpeed does."""
    import torch.distributed as dist

    params = [p for p in parameters if p.grad is not None]
    counted = [p for p in params if getattr(p, COUNTED_IN_NORM, False)]
    total = _squares([p for p in counted if expert_group is None or not _is_expert(p)])
    if expert_group is not None:
        expert_total = _squares([p for p in counted if _is_expert(p)])
        dist.all_reduce(expert_total, op=dist.ReduceOp.SUM, group=expert_group)
        total = total + expert_total
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.dtype))
    return norm


def _squares(params: list[torch.Tensor]) -> torch.Tensor:
    norms = [p.grad.detach().float().norm(2) for p in params]
    return torch.stack(norms).pow(2).sum() if norms else torch.zeros(())


def _is_expert(p: torch.Tensor) -> bool:
    """DeepSpeed's `is_moe_param`: an expert's parameter, not reduced over all data-parallel ranks."""
    return hasattr(p, "allreduce") and not p.allreduce


def grad_norm(engine: Any) -> float | None:
    """The last step's global gradient norm, or None when this path does not compute one."""
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if isinstance(norm, torch.Tensor) else norm)


@torch.no_grad()
def params_norm(engine: Any) -> float:
    """Megatron's `calc_params_l2_norm` (`--log-params-norm`): the L2 norm of every parameter, each
    counted once over stages and tensor ranks (the same marking as the gradient norm), in fp32.
    Collective over the model-parallel group."""
    import torch.distributed as dist

    squares = [
        p.detach().float().pow(2).sum() for p in engine.module.parameters() if getattr(p, COUNTED_IN_NORM, False)
    ]
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    total = total.to(engine.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=engine.mpu.get_model_parallel_group())
    return float(total.sqrt().item())


class ZeroCounter:
    """`--log-num-zeros-in-grad`: zero elements of the reduced gradients of the last step, each
    counted once (Megatron's `count_zeros_fp32`), read just before DeepSpeed's optimizer step, after
    the data-parallel and tied reductions. The count of this rank is kept; `total` sums it over the
    model-parallel group (outside the step, so no collective runs inside the engine's schedule)."""

    def __init__(self, engine: Any) -> None:
        from deepspeed.runtime.pipe import schedule

        self.engine, self.local = engine, 0
        step = schedule.OptimizerStep
        table = engine.__dict__.setdefault("_INSTRUCTION_MAP", dict(type(engine)._INSTRUCTION_MAP))
        run_step = table[step]

        def counted(eng: Any, *args: Any, **kwargs: Any) -> Any:
            self.local = self._count()
            return run_step(eng, *args, **kwargs)

        table[step] = counted

    def _count(self) -> int:
        grads = [
            p.grad for p in self.engine.module.parameters() if p.grad is not None and getattr(p, COUNTED_IN_NORM, False)
        ]
        return int(sum(int(g.numel() - torch.count_nonzero(g)) for g in grads))

    def total(self) -> int:
        import torch.distributed as dist

        count = torch.tensor([float(self.local)], device=self.engine.device)
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=self.engine.mpu.get_model_parallel_group())
        return int(count.item())
