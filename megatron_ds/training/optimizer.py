"""Optimizer parameter groups with one structure on every stage, and the optimizer itself.

Why the structure matters: DeepSpeed's ZeRO optimizer computes the gradient norm once per
parameter group, and each computation all-reduces over the model-parallel group, which spans all
pipeline stages. A stage that holds only the embedding has no bias or norm weight, so its
"no weight decay" group would be empty (DeepSpeed drops empty groups): it would then issue one
collective fewer than the other stages and the job deadlocks. Here every stage builds the same
groups, in the same order, and an empty group receives a one-element placeholder parameter
(`GROUP_PLACEHOLDER_PREFIX`): one element, zero, never used in forward, so its gradient is zero, Adam
and weight decay keep it at zero, and it adds nothing to the gradient norm. (A zero-element
placeholder would not do: DeepSpeed's ZeRO leaves zero-element parameters out of its groups.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megatron_ds.config import OptimizerConfig
from megatron_ds.estimate.model_states import optimizer_kernel_options

GROUP_NAMES = ("decay", "no_decay")
OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
"""Builds an optimizer from `param_groups`' list (each group: "name", "params", "weight_decay")."""
GROUP_PLACEHOLDER_PREFIX = "optimizer_group_placeholder_"


def _wants_decay(name: str, param: nn.Parameter) -> bool:
    # Megatron's rule: no weight decay on biases and norm weights, i.e. 1-D parameters (by the full
    # shape: a ZeRO-3 parameter's data is its flat partition, its shape `ds_shape`).
    return len(getattr(param, "ds_shape", param.shape)) >= 2 and not name.startswith(GROUP_PLACEHOLDER_PREFIX)


def add_group_placeholders(module: nn.Module) -> list[str]:
    """Register a one-element zero parameter for each group this module would leave empty.

    Returns the names of the groups that needed one. Call once, before the DeepSpeed engine is
    built, so the placeholders are ordinary parameters of the module.
    """
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    present = {GROUP_NAMES[0] if _wants_decay(n, p) else GROUP_NAMES[1] for n, p in params}
    missing = [g for g in GROUP_NAMES if g not in present]
    for group in missing:
        module.register_parameter(GROUP_PLACEHOLDER_PREFIX + group, nn.Parameter(torch.zeros(1)))
    return missing


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The groups `GROUP_NAMES` in order; each is non-empty after `add_group_placeholders`
    (an empty one is reported by the preflight check, as DeepSpeed would silently drop it)."""
    groups: dict[str, list[nn.Parameter]] = {g: [] for g in GROUP_NAMES}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith(GROUP_PLACEHOLDER_PREFIX):
            groups[name[len(GROUP_PLACEHOLDER_PREFIX) :]].append(p)
        else:
            groups[GROUP_NAMES[0] if _wants_decay(name, p) else GROUP_NAMES[1]].append(p)
    decay = {GROUP_NAMES[0]: weight_decay, GROUP_NAMES[1]: 0.0}
    return [{"name": g, "params": groups[g], "weight_decay": decay[g]} for g in GROUP_NAMES]


def build_optimizer(
    module: nn.Module, cfg: OptimizerConfig, factory: OptimizerFactory | None = None, cpu_adam: bool = False
) -> torch.optim.Optimizer:
    """`factory(param_groups(...))`, or by default AdamW (Megatron's `adam` is decoupled weight
    decay) or SGD as `cfg` says. The groups carry `cfg.weight_decay` either way.

    The kernel is `estimate.model_states.OPTIMIZER_KERNEL` for this machine's device (fused on CUDA,
    one tensor at a time on CPU), the one the memory model counts the temporaries of. `cpu_adam`
    (`--cpu-optimizer`): DeepSpeed's CPU Adam instead (`DeepSpeedCPUAdam` in AdamW mode, as
    Megatron-DeepSpeed builds it; DeepSpeed compiles its op on first use, into the torch extensions cache).
    """
    groups = param_groups(module, cfg.weight_decay)
    if factory is not None:
        return factory(groups)
    if cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        assert cfg.optimizer == "adam", cfg.optimizer  # Config refuses --cpu-optimizer with SGD
        betas = (cfg.adam_beta1, cfg.adam_beta2)
        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    kernel = optimizer_kernel_options("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.optimizer == "adam":
        return torch.optim.AdamW(
            groups,
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            **kernel,
        )
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum, weight_decay=cfg.weight_decay, **kernel)
    raise AssertionError(cfg.optimizer)
