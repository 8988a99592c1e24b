"""The DeepSpeed engine's gradient norm: the counted fp32 clip, and reading the last step's norm."""

from __future__ import annotations

from collections.abc import Callable
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
    """Global L2 norm over the gradients this rank counts (`counted_grad_norm`), then scale every gradient as
    DeepSpeed does."""
    params = [p for p in parameters if p.grad is not None]
    norm = counted_grad_norm(params, group, expert_group)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.dtype))
    return norm


@torch.no_grad()
def counted_grad_norm(parameters: Any, group: Any, expert_group: Any = None) -> torch.Tensor:
    """Global L2 norm (fp32) over the gradients this rank counts, all-reduced over `group` (every stage and tensor
    rank of one data-parallel replica); the experts' squares summed over `expert_group` too."""
    counted = [p for p in parameters if p.grad is not None and getattr(p, COUNTED_IN_NORM, False)]
    return _summed_squares(counted, lambda p: p.grad.detach().float().norm(2).pow(2), group, expert_group).sqrt()


def install_mixed_precision_expert_norm(engine: Any) -> None:
    """A mixture-of-experts model under --bf16/--fp16 without ZeRO: clip by the norm that counts the experts.

    DeepSpeed wraps torch's AdamW there in `FP16_UnfusedOptimizer`, whose step leaves the experts' gradients out of
    the norm (`split_params_grads_into_shared_and_expert_params`); Megatron-DeepSpeed's fused Adam gets
    `FP16_Optimizer`, which counts each expert once over its expert-parallel group (`get_norm_with_moe_layers`), as
    DeepSpeed's ZeRO 1/2 and the fp32 clip here do. This instance-level replacement of its `unscale_and_clip_grads`
    hands it that norm (of the loss-scaled gradients, DeepSpeed's convention there) and keeps it as the step's norm.
    """
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    optimizer, expert_group = engine.optimizer, expert_parallel_group(engine)
    if expert_group is None or not isinstance(optimizer, FP16_UnfusedOptimizer):
        return
    unscale_and_clip = optimizer.unscale_and_clip_grads

    def with_experts_counted(total_norm: float, apply_scale: bool = True) -> Any:
        del total_norm  # the non-expert gradients' norm
        params = engine.module.parameters()
        norm = float(counted_grad_norm(params, engine.mpu.get_model_parallel_group(), expert_group))
        optimizer._global_grad_norm = norm
        return unscale_and_clip(norm, apply_scale)

    optimizer.unscale_and_clip_grads = with_experts_counted


def _summed_squares(
    params: list[torch.Tensor],
    square: Callable[[torch.Tensor], torch.Tensor],
    group: Any,
    expert_group: Any,
    device: Any = None,
) -> torch.Tensor:
    """The sum of `square(p)` over `params` (on `device` when given), all-reduced over `group`; a mixture-of-experts
    model's experts (each held by one rank of `expert_group`) summed over `expert_group` first."""
    import torch.distributed as dist

    def total(ps: list[torch.Tensor]) -> torch.Tensor:
        squares = [square(p) for p in ps]
        summed = torch.stack(squares).sum() if squares else torch.zeros(())
        return summed if device is None else summed.to(device)

    summed = total([p for p in params if expert_group is None or not _is_expert(p)])
    if expert_group is not None:
        experts = total([p for p in params if _is_expert(p)])
        dist.all_reduce(experts, op=dist.ReduceOp.SUM, group=expert_group)
        summed = summed + experts
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    return summed


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
    Collective over the model-parallel group, and over the expert-parallel group for a mixture-of-experts model:
    the experts' squares are summed over it, the whole model's norm as the clip's (Megatron-DeepSpeed's counts the
    logging rank's own experts only)."""
    counted = [p for p in engine.module.parameters() if getattr(p, COUNTED_IN_NORM, False)]
    group, expert_group = engine.mpu.get_model_parallel_group(), expert_parallel_group(engine)
    total = _summed_squares(counted, lambda p: p.detach().float().pow(2).sum(), group, expert_group, engine.device)
    return float(total.sqrt().item())


class ZeroCounter:
    """`--log-num-zeros-in-grad`: zero elements of the reduced gradients of the last step, each
    counted once (Megatron's `count_zeros_fp32`), read just before DeepSpeed's optimizer step, after
    the data-parallel and tied reductions. The counts of this rank are kept; `total` sums them over the
    model-parallel group (outside the step, so no collective runs inside the engine's schedule), a
    mixture-of-experts model's expert gradients over the expert-parallel group first (each expert is held by
    one rank of it), so the count is the whole model's, as the one-process run's."""

    def __init__(self, engine: Any) -> None:
        from deepspeed.runtime.pipe import schedule

        self.engine, self.local, self.local_experts = engine, 0, 0
        self.expert_group = expert_parallel_group(engine)
        step = schedule.OptimizerStep
        table = engine.__dict__.setdefault("_INSTRUCTION_MAP", dict(type(engine)._INSTRUCTION_MAP))
        run_step = table[step]

        def counted(eng: Any, *args: Any, **kwargs: Any) -> Any:
            self.local, self.local_experts = self._count()
            return run_step(eng, *args, **kwargs)

        table[step] = counted

    def _count(self) -> tuple[int, int]:
        """(zeros of the gradients every expert-parallel rank holds alike, zeros of this rank's experts)."""
        counts = [0, 0]
        for p in self.engine.module.parameters():
            if p.grad is not None and getattr(p, COUNTED_IN_NORM, False):
                expert = self.expert_group is not None and _is_expert(p)
                counts[expert] += int(p.grad.numel() - torch.count_nonzero(p.grad))
        return counts[0], counts[1]

    def total(self) -> int:
        import torch.distributed as dist

        experts = torch.tensor([float(self.local_experts)], device=self.engine.device)
        if self.expert_group is not None:
            dist.all_reduce(experts, op=dist.ReduceOp.SUM, group=self.expert_group)
        count = experts + float(self.local)
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=self.engine.mpu.get_model_parallel_group())
        return int(count.item())
