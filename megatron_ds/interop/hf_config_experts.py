"""The mixture-of-experts readers of a Hugging Face `config.json` (Mixtral, Qwen3-MoE, Qwen2-MoE): the experts and
their router as pretrain_gpt.py's flags, on the dense layer `hf_config_read` reads (it calls these through `READERS`,
passing its Llama-layout reader as `dense`; this module imports nothing of it). A field we do not build is a
`HFConfigError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_ds.interop.hf_architectures import MIXTRAL, QWEN2_MOE, QWEN3_MOE, HFConfigError

Dense = Callable[[Any, str], Any]
"""`hf_config_read._from_llama`: (its config.json fields, the model type) -> its `HFModel`, the dense layer's flags."""


def from_mixtral(f: Any, dense: Dense) -> Any:
    """Mixtral: Mistral's layer with DeepSpeed's MoE layer on every layer (`hf_architectures.MIXTRAL_REQUIRES`). Its router
    (softmax, the k best renormalized, every token routed) is, at top-2, our top-2 gate trained without token dropping
    or a sampled second expert (the routing flags that compute Mixtral's model; a later launch may change them: they
    shape no weight), and at any other k Megatron-LM's top-k router (`--moe-router-topk`)."""
    f.require("router_jitter_noise", (0, 0.0), 0.0, "the router's training-time input noise is not built")
    experts, k = _experts(f, "num_local_experts", ..., 2)
    model = dense(f, MIXTRAL)
    coeff = f.get("router_aux_loss_coef", float, 0.001)  # MixtralConfig's default
    if k != 2:
        return _top_k_router(model, experts, k, coeff)
    model.architecture |= {"num_experts": [experts], "expert_interval": 1, "topk": 2, "mlp_type": "standard"}
    model.defaults |= {
        "moe_loss_coeff": coeff,
        "disable_moe_token_dropping": False,
        "disable_moe_top2_2nd_expert_sampling": False,
    }
    return model


def from_qwen3_moe(f: Any, dense: Dense) -> Any:
    """Qwen3-MoE: Qwen3's layer with experts on every layer (`decoder_sparse_step` 1, no `mlp_only_layers`), each
    `moe_intermediate_size` wide, routed by Megatron-LM's top-k router (the softmax renormalized over the k chosen
    with `norm_topk_prob`, else not: `--moe-router-pre-softmax`), its sliding window on every layer when
    `use_sliding_window`."""
    _experts_on_every_layer(f)
    experts, k = _experts(f, "num_experts" if "num_experts" in f.hf else "num_local_experts", 128, 8)
    hf = dict(f.hf)
    hf["intermediate_size"] = f.size("moe_intermediate_size", 768)  # every layer's MLP is experts
    if not f.get("use_sliding_window", bool, False):
        hf["sliding_window"] = None
    model = dense(type(f)(hf, f.source), QWEN3_MOE)
    model = _top_k_router(model, experts, k, f.get("router_aux_loss_coef", float, 0.001))  # Qwen3MoeConfig's default
    if not f.get("norm_topk_prob", bool, False):  # Qwen3MoeConfig's default: the softmax over every expert
        model.architecture["moe_router_pre_softmax"] = True
    return model


def from_qwen2_moe(f: Any, dense: Dense) -> Any:
    """Qwen2-MoE: Qwen2's layer (q/k/v biases) with experts on every layer, each `moe_intermediate_size` wide, and a
    gated shared expert `shared_expert_intermediate_size` wide beside them (`--moe-shared-expert-intermediate-size N
    --moe-shared-expert-gate`), routed by Megatron-LM's top-k router: `norm_topk_prob` false (its default) is
    `--moe-router-pre-softmax` (the softmax over every expert, not renormalized), true the softmax renormalized."""
    _experts_on_every_layer(f)
    f.require("use_sliding_window", (False,), False, "Qwen2-MoE's sliding window is not built here")
    experts, k = _experts(f, "num_experts", 60, 4)
    shared = f.size("shared_expert_intermediate_size", 5632)
    pre_softmax = not f.get("norm_topk_prob", bool, False)
    hf = dict(f.hf)
    hf["intermediate_size"] = f.size("moe_intermediate_size", 1408)  # every layer's MLP is experts
    hf["sliding_window"] = None
    model = dense(type(f)(hf, f.source), QWEN2_MOE)
    model = _top_k_router(model, experts, k, f.get("router_aux_loss_coef", float, 0.001))  # Qwen2MoeConfig's default
    model.architecture |= {"moe_shared_expert_intermediate_size": shared, "moe_shared_expert_gate": True}
    if pre_softmax:  # a switch: absent is renormalized
        model.architecture["moe_router_pre_softmax"] = True
    return model


def _experts_on_every_layer(f: Any) -> None:
    """Qwen's `decoder_sparse_step` 1 and no `mlp_only_layers`: dense layers between the experts' would be of another
    width (`intermediate_size`) than the experts' here."""
    why = "experts on every layer only (dense layers here are the experts' width)"
    f.require("decoder_sparse_step", (1,), 1, why)
    f.require("mlp_only_layers", ([], None), [], why)


def _experts(f: Any, field: str, default: Any, default_k: int) -> tuple[int, int]:
    """(experts per layer, experts per token) of a mixture of experts: `field` (2 or more) and
    `num_experts_per_tok` (at most that many)."""
    experts = f.size(field, default)
    if experts < 2:
        raise HFConfigError(f"{f.source}: {field} {experts}: a mixture of experts needs 2 or more")
    k = f.size("num_experts_per_tok", default_k)
    if k > experts:
        raise HFConfigError(f"{f.source}: num_experts_per_tok {k} is more than {field} {experts}; fix the config.json")
    return experts, k


def _top_k_router(model: Any, experts: int, k: int, coeff: float) -> Any:
    """`model` with `experts` on every layer routed by Megatron-LM's top-k router (softmax, the k best renormalized:
    `--moe-router-topk`), its coefficient `router_aux_loss_coef` a flag a later launch may change."""
    model.architecture |= {"num_experts": [experts], "moe_router_topk": k}
    model.defaults |= {"moe_aux_loss_coeff": coeff}
    return model


READERS: dict[str, Callable[[Any, Dense], Any]] = {
    MIXTRAL: from_mixtral,
    QWEN3_MOE: from_qwen3_moe,
    QWEN2_MOE: from_qwen2_moe,
}
"""model_type -> its reader: (config.json's fields, `hf_config_read._Fields`; the dense reader) -> its `HFModel`."""
