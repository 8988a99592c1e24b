"""The mixture-of-experts fields of `ModelConfig`: which layers have experts, how many, and how tokens are routed
(Megatron-DeepSpeed's `--num-experts`, `--expert-interval`, `--mlp-type` and DeepSpeed's gates; or Megatron-LM's top-k
router), checked and stored in one spelling. The layer itself is `megatron_ds.model.moe`."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_ds.config.checks import at_least, check, one_of, positive

MLP_TYPES = ("standard", "residual")
"""Megatron-DeepSpeed's `--mlp-type` of a mixture-of-experts layer: experts alone, or PR-MoE's residual MLP beside
them (DeepSpeed's `MoE(use_residual=True)`)."""
MOE_TOP_K = (1, 2)
"""The gates DeepSpeed's MoE layer documents (`--topk`): top-1 and top-2."""
MOE_ROUTERS = ("deepspeed", "megatron")
"""How a token picks its experts (`ModelConfig.moe_router`): Megatron-DeepSpeed's gates, or Megatron-LM's top-k
router."""
MOE_ROUTING_FIELDS = (
    "moe_router",
    "moe_router_pre_softmax",
    "moe_top_k",
    "moe_train_capacity_factor",
    "moe_eval_capacity_factor",
    "moe_min_capacity",
    "moe_token_dropping",
    "moe_top2_2nd_expert_sampling",
    "moe_loss_coeff",
)
"""The mixture-of-experts fields that shape no weight (how tokens are routed, the auxiliary loss's weight): stored
at their defaults in a dense model, and free to change on resume (`training.checkpoint.rules.WEIGHT_FREE_FIELDS`)."""


SHARED_EXPERT_FIELDS = ("moe_shared_expert_size", "moe_shared_expert_gate")
"""The shared expert beside a MoE layer's routed ones (Megatron-LM's `--moe-shared-expert-*`): architecture, stored at
their defaults in a dense model."""


def experts_per_layer(num_experts: tuple[int, ...], num_layers: int, expert_interval: int) -> tuple[int, ...]:
    """Experts of each transformer layer, as Megatron-DeepSpeed's `get_num_experts_per_layer`: layer i (from 1) has
    experts when i is a multiple of `expert_interval`, the k-th such layer `num_experts[k - 1]` (one value: every
    such layer); every other layer is dense (1)."""
    groups = num_layers // expert_interval
    counts = num_experts * groups if len(num_experts) == 1 else num_experts
    return tuple(
        counts[(i - 1) // expert_interval] if i % expert_interval == 0 else 1 for i in range(1, num_layers + 1)
    )


def check_experts(model: Any) -> None:
    """`ModelConfig`'s mixture-of-experts fields checked, and stored in one spelling (a dense model's at their defaults;
    Megatron-LM's router's without DeepSpeed's gate fields). A dense model's routing fields are checked as a mixture of
    experts' are before they are reset (`--topk 3`, or Megatron-LM's pre-softmax or shared expert with DeepSpeed's
    gates, is refused with or without experts): one rule, whether the layers have experts or not."""
    object.__setattr__(model, "num_experts", tuple(int(n) for n in model.num_experts))  # a JSON list on load
    given = " ".join(map(str, model.num_experts))
    check(
        len(model.num_experts) >= 1 and all(n >= 1 for n in model.num_experts),
        f"--num-experts {given} must be one or more counts >= 1",
    )
    at_least("--expert-interval", model.expert_interval, 1)
    groups = model.num_layers // model.expert_interval
    check(
        len(model.num_experts) in (1, groups),
        f"--num-experts {given} gives {len(model.num_experts)} counts, but --num-layers {model.num_layers} with "
        f"--expert-interval {model.expert_interval} has {groups} expert layers; give one count, or {groups}",
    )
    one_of("--mlp-type", model.mlp_type, MLP_TYPES)
    one_of("--moe-router", model.moe_router, MOE_ROUTERS)
    if model.moe_router == "megatron":  # one spelling: its routing reads none of DeepSpeed's gate fields
        at_least("--moe-router-topk", model.moe_top_k, 1)
        defaults = {f.name: f.default for f in dataclasses.fields(model)}
        for name in ("moe_train_capacity_factor", "moe_eval_capacity_factor", "moe_min_capacity"):
            object.__setattr__(model, name, defaults[name])
        object.__setattr__(model, "moe_token_dropping", False)
        object.__setattr__(model, "moe_top2_2nd_expert_sampling", False)
    else:
        one_of("--topk", model.moe_top_k, MOE_TOP_K)
        check(
            not model.moe_router_pre_softmax,
            "--moe-router-pre-softmax is Megatron-LM's router's; with DeepSpeed's gates (--topk) drop it, or route with "
            "Megatron-LM's router (--moe-router-topk)",
        )
    _check_shared_expert(model)
    positive("--moe-train-capacity-factor", model.moe_train_capacity_factor)
    positive("--moe-eval-capacity-factor", model.moe_eval_capacity_factor)
    at_least("--moe-min-capacity", model.moe_min_capacity, 0)
    at_least("--moe-loss-coeff", model.moe_loss_coeff, 0.0)
    if not model.is_moe:  # one spelling of a dense model (as the rotary fields above)
        defaults = {f.name: f.default for f in dataclasses.fields(model)}
        for name in ("num_experts", "expert_interval", "mlp_type", *SHARED_EXPERT_FIELDS, *MOE_ROUTING_FIELDS):
            object.__setattr__(model, name, defaults[name])
        return
    few = min(n for n in model.experts_per_layer if n > 1)
    flag = "--moe-router-topk" if model.moe_router == "megatron" else "--topk"
    check(
        model.moe_top_k <= few,
        f"{flag} {model.moe_top_k} sends each token to {model.moe_top_k} experts, but a layer has {few}; "
        f"use a smaller {flag} or more experts",
    )


def _check_shared_expert(model: Any) -> None:
    """Megatron-LM's shared expert: with its router only (DeepSpeed's gates never had one), not beside PR-MoE's
    residual MLP, and its gate only with it."""
    size = model.moe_shared_expert_size
    at_least("--moe-shared-expert-intermediate-size", size, 0)
    check(
        size == 0 or model.moe_router == "megatron",
        f"--moe-shared-expert-intermediate-size {size} is Megatron-LM's router's; with DeepSpeed's gates (--topk) drop "
        "it, or route with Megatron-LM's router (--moe-router-topk)",
    )
    check(
        size == 0 or model.mlp_type == "standard",
        f"--moe-shared-expert-intermediate-size {size} with --mlp-type residual: PR-MoE's residual MLP is already a "
        "dense MLP beside the experts; keep one",
    )
    check(
        size == 0 or not model.add_bias_linear,
        f"--moe-shared-expert-intermediate-size {size} with biases: megatron-core's shared expert has none; add "
        "--disable-bias-linear",
    )
    check(
        not model.moe_shared_expert_gate or size > 0,
        "--moe-shared-expert-gate gates the shared expert, and there is none; add "
        "--moe-shared-expert-intermediate-size N, or drop it",
    )
