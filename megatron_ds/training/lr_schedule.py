"""Learning-rate schedule with Megatron's semantics: linear warm-up, then decay to min_lr.

lr(i) = lr * i / warmup                                   for i <= warmup
      = min_lr + (lr - min_lr) * f((i - warmup) / (decay - warmup))   for warmup < i <= decay
      = min_lr                                             after decay
with f = 1 (constant), 1 - x (linear) or (cos(pi x) + 1) / 2 (cosine). `i` counts optimizer steps
already taken, as in Megatron's OptimizerParamScheduler (so with warm-up the first step has lr 0).
DeepSpeed calls `step()` after each optimizer step and stores `state_dict()` in checkpoints.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from megatron_ds.config import OptimizerConfig


def learning_rate(cfg: OptimizerConfig, step: int, train_iters: int) -> float:
    """The learning rate for optimizer step number `step` (0-based count of steps already taken)."""
    warmup = cfg.lr_warmup_iters
    decay = cfg.lr_decay_iters or train_iters
    if warmup > 0 and step <= warmup:
        return cfg.lr * step / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    if step > decay:
        return cfg.min_lr
    x = (step - warmup) / (decay - warmup)
    if cfg.lr_decay_style == "linear":
        factor = 1.0 - x
    else:
        factor = 0.5 * (math.cos(math.pi * x) + 1.0)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor


class LRSchedule:
    """Sets each parameter group's lr; stateful only through the step count."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, train_iters: int) -> None:
        self.optimizer, self.cfg, self.train_iters = optimizer, cfg, train_iters
        self.num_steps = 0
        self._apply()

    def _apply(self) -> None:
        lr = learning_rate(self.cfg, self.num_steps, self.train_iters)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def step(self, increment: int = 1, **_: Any) -> None:
        self.num_steps += increment
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()
