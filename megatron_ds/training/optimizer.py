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
from megatron_ds.model.gpt_pipe import EMBEDDING_OR_OUTPUT

GROUP_NAMES = ("decay", "no_decay")
DECOUPLED_GROUP = "decoupled"
"""Megatron-LM's `--decoupled-lr` group: the word embedding and output layer weights (marked by
`model.gpt_pipe.mark_embedding_and_output`), with weight decay; a third group only with that flag."""
OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
"""Builds an optimizer from `param_groups`' list (each group: "name", "params", "weight_decay")."""
GROUP_PLACEHOLDER_PREFIX = "optimizer_group_placeholder_"
EXPERT_PLACEHOLDER_SUFFIX = "_experts"
"""Ends the name of a group's expert placeholder (`add_group_placeholders(expert_group=...)`)."""


def group_names(decoupled: bool) -> tuple[str, ...]:
    """The groups every stage builds, in order."""
    return (*GROUP_NAMES, DECOUPLED_GROUP) if decoupled else GROUP_NAMES


def _group_of(name: str, param: nn.Parameter, decoupled: bool) -> str:
    if decoupled and getattr(param, EMBEDDING_OR_OUTPUT, False):
        return DECOUPLED_GROUP
    return GROUP_NAMES[0] if _wants_decay(name, param) else GROUP_NAMES[1]


def _wants_decay(name: str, param: nn.Parameter) -> bool:
    # Megatron's rule: no weight decay on biases and norm weights, i.e. 1-D parameters (by the full
    # shape: a ZeRO-3 parameter's data is its flat partition, its shape `ds_shape`).
    return len(getattr(param, "ds_shape", param.shape)) >= 2 and not name.startswith(GROUP_PLACEHOLDER_PREFIX)


def add_group_placeholders(module: nn.Module, decoupled: bool = False, expert_group: str | None = None) -> list[str]:
    """Register a one-element zero parameter for each group this module would leave empty
    (`decoupled`: the `--decoupled-lr` group is one of them).

    `expert_group` (a mixture-of-experts model on the pipeline engine under `--create-moe-param-group`: DeepSpeed's
    expert-parallel group name, `ep_size_E`): each of those groups also gets an expert placeholder (DeepSpeed's
    expert marks, `allreduce` False) where it holds no expert, so DeepSpeed's split gives every stage the same expert
    groups, the embedding's stage and a stage of dense layers too.

    Returns the names of the groups that needed one. Call once, before the DeepSpeed engine is
    built, so the placeholders are ordinary parameters of the module.
    """
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    present = {_group_of(n, p, decoupled) for n, p in params}
    missing = [g for g in group_names(decoupled) if g not in present]
    for group in missing:
        module.register_parameter(GROUP_PLACEHOLDER_PREFIX + group, nn.Parameter(torch.zeros(1)))
    if expert_group is None:
        return missing
    with_experts = {_group_of(n, p, decoupled) for n, p in params if not getattr(p, "allreduce", True)}
    for group in [g for g in GROUP_NAMES if g not in with_experts]:
        placeholder = nn.Parameter(torch.zeros(1))
        placeholder.allreduce, placeholder.group_name = False, expert_group  # DeepSpeed's `is_moe_param` marks
        module.register_parameter(GROUP_PLACEHOLDER_PREFIX + group + EXPERT_PLACEHOLDER_SUFFIX, placeholder)
        missing.append(group + EXPERT_PLACEHOLDER_SUFFIX)
    return missing


def _unmark_lone_expert_placeholders(module: nn.Module) -> None:
    """On a stage without experts, the expert placeholders lose DeepSpeed's expert marks once they are in their
    groups: DeepSpeed's engine reduces a marked gradient by its expert group, which it knows only on stages that hold
    a MoE layer."""
    named = list(module.named_parameters())
    if any(not getattr(p, "allreduce", True) for n, p in named if not n.startswith(GROUP_PLACEHOLDER_PREFIX)):
        return
    for name, p in named:
        if name.endswith(EXPERT_PLACEHOLDER_SUFFIX) and name.startswith(GROUP_PLACEHOLDER_PREFIX):
            del p.allreduce, p.group_name


def param_groups(module: nn.Module, weight_decay: float, decoupled: bool = False) -> list[dict[str, Any]]:
    """The groups `group_names(decoupled)` in order; each is non-empty after `add_group_placeholders`
    (an empty one is reported by the preflight check, as DeepSpeed would silently drop it). Each
    carries Megatron's `wd_mult` (what a scheduled weight decay is multiplied by), and the
    decoupled group its `decoupled` mark (`training.lr_schedule`)."""
    names = group_names(decoupled)
    groups: dict[str, list[nn.Parameter]] = {g: [] for g in names}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith(GROUP_PLACEHOLDER_PREFIX):
            groups[name[len(GROUP_PLACEHOLDER_PREFIX) :].removesuffix(EXPERT_PLACEHOLDER_SUFFIX)].append(p)
        else:
            groups[_group_of(name, p, decoupled)].append(p)
    mult = {GROUP_NAMES[0]: 1.0, GROUP_NAMES[1]: 0.0, DECOUPLED_GROUP: 1.0}
    out = [{"name": g, "params": groups[g], "weight_decay": weight_decay * mult[g], "wd_mult": mult[g]} for g in names]
    for group in out:
        if group["name"] == DECOUPLED_GROUP:
            group["decoupled"] = True
    return out


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
    groups = param_groups(module, cfg.weight_decay, decoupled=cfg.decoupled_lr is not None)
    if cfg.create_moe_param_group:  # Megatron-DeepSpeed's --create-moe-param-group: experts in groups of their own
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(groups)
        _unmark_lone_expert_placeholders(module)
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


def refresh_fp32_copies(optimizer: Any) -> None:
    """After the model's weights were written in place: ZeRO's and the bf16/fp16 optimizers' fp32 copies of them (made
    when the engine was built) taken again, else the first step would write the old weights back; a plain torch
    optimizer (fp32, no ZeRO) steps the weights themselves and has none."""
    if getattr(optimizer, "refresh_fp32_params", None) is not None:
        optimizer.refresh_fp32_params()
