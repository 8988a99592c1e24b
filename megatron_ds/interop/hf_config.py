"""Our ModelConfig -> a Hugging Face `config.json` (`to_hf_config`), for the architecture `hf_architectures.py`
finds the model to be; reading one back is `hf_config_read.py`.

The Llama-layout types' and Mixtral's `head_dim` is our `--kv-channels` (hidden_size / num_attention_heads when absent, Qwen3's 128). Sliding windows
are Megatron-LM's `--window-size LEFT,0` with transformers' `sliding_window` LEFT + 1 (a key k is seen by the query q
when q - sliding_window < k <= q): Mistral's, Mixtral's and Phi-3's on every layer, Qwen2's and Qwen3's with
`use_sliding_window` on the layers `layer_types` names `sliding_attention` (`--window-attn-skip-freq`'s pattern).
Mixtral's router (and Qwen3-MoE's, with `norm_topk_prob`) is DeepSpeed's top-2 gate computed without capacity (softmax
over the experts, the two best renormalized), as our inference routes (`moe.route_every_token`), or Megatron-LM's
top-k router at any k; `export_notes` says where training routed otherwise. Each architecture ties or unties its LM head (`tie_word_embeddings`). Activation names come from
`megatron_ds.model.activations` (`hf_names`). Nothing here imports transformers.
"""

from __future__ import annotations

from typing import Any

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.config.model import LLAMA3_ROPE_SCALING
from megatron_ds.interop.hf_architectures import (
    ARCHITECTURE_CLASSES,
    GPT2,
    MISTRAL,
    MIXTRAL,
    PHI3,
    QWEN2,
    QWEN2_MOE,
    QWEN3,
    QWEN3_MOE,
    architecture_of,
)
from megatron_ds.model import activations


def to_hf_config(
    model: ModelConfig,
    regularization: RegularizationConfig,
    vocab_size: int,
    dtype: str,
    special: dict[str, int],
    model_type: str | None = None,
) -> dict[str, Any]:
    """`config.json` for `model` with `vocab_size` rows (padding removed); `special` holds token ids;
    dropout and the init std come from `regularization`; `model_type` as `architecture_of`'s."""
    arch = architecture_of(model, model_type)
    common = {
        "architectures": [ARCHITECTURE_CLASSES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "initializer_range": regularization.init_method_std,
        "torch_dtype": dtype,
        "use_cache": True,
        "bos_token_id": None,  # transformers' GPT-2 default (50256) would name a token we may not have
        "eos_token_id": None,
        **special,
    }
    if arch == GPT2:
        return {
            **common,
            "n_layer": model.num_layers,
            "n_embd": model.hidden_size,
            "n_head": model.num_attention_heads,
            "n_inner": model.ffn_hidden_size,
            "n_positions": model.max_position_embeddings,
            "activation_function": activations.find(model.activation).hf_names[0],
            "layer_norm_epsilon": model.layernorm_epsilon,
            "resid_pdrop": regularization.hidden_dropout,
            "embd_pdrop": regularization.hidden_dropout,
            "attn_pdrop": regularization.attention_dropout,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }
    if arch == PHI3:
        return {**common, **_phi3_fields(model, regularization)}
    return {**common, **_llama_layout_fields(model, regularization), **_type_fields(arch, model)}


def _mixtral_fields(model: ModelConfig) -> dict[str, Any]:
    """Mixtral's experts and its router (top-k renormalized, no jitter)."""
    return {
        "num_local_experts": model.experts_per_layer[0],
        "num_experts_per_tok": model.moe_top_k,
        "router_aux_loss_coef": model.moe_loss_coeff,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
    }


def _qwen3_moe_fields(model: ModelConfig) -> dict[str, Any]:
    """Qwen3-MoE's experts on every layer (each of the MLP's width) and its router (top-k renormalized, or not:
    `--moe-router-pre-softmax`), its window on every layer or none, no biases."""
    window = _sliding_window(model)
    return {
        "attention_bias": False,
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "num_experts": model.experts_per_layer[0],
        "num_experts_per_tok": model.moe_top_k,
        "moe_intermediate_size": model.ffn_hidden_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": not model.moe_router_pre_softmax,
        "router_aux_loss_coef": model.moe_loss_coeff,
        "output_router_logits": False,
    }


def _qwen2_moe_fields(model: ModelConfig) -> dict[str, Any]:
    """Qwen2-MoE's experts on every layer (each of the MLP's width), its gated shared expert, its router (renormalized
    over the k chosen, or not: `--moe-router-pre-softmax`), q/k/v biases, no sliding window."""
    return {
        "qkv_bias": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": model.num_layers,
        "num_experts": model.experts_per_layer[0],
        "num_experts_per_tok": model.moe_top_k,
        "moe_intermediate_size": model.ffn_hidden_size,
        "shared_expert_intermediate_size": model.moe_shared_expert_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": not model.moe_router_pre_softmax,
        "router_aux_loss_coef": model.moe_loss_coeff,
        "output_router_logits": False,
    }


def _sliding_window(model: ModelConfig) -> int | None:
    """transformers' `sliding_window` of a window on every layer (LEFT + 1 keys, the query's own included), or None."""
    return None if model.window_size is None else model.window_size[0] + 1


def _type_fields(arch: str, model: ModelConfig) -> dict[str, Any]:
    """What Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE and Qwen2-MoE's config.json say differently: biases, the
    sliding window and the experts."""
    if arch == QWEN2:  # q/k/v biases are built in
        return _qwen_window(model)
    if arch == QWEN3:  # q/k norms are built in; attention_bias would add o_proj's too
        return {**_qwen_window(model), "attention_bias": False}
    if arch == MISTRAL:  # on every layer (MISTRAL_REQUIRES)
        return {"sliding_window": _sliding_window(model)}
    if arch == MIXTRAL:  # on every layer (MIXTRAL_REQUIRES)
        return {"sliding_window": _sliding_window(model), **_mixtral_fields(model)}
    if arch == QWEN3_MOE:
        return _qwen3_moe_fields(model)
    if arch == QWEN2_MOE:
        return _qwen2_moe_fields(model)
    return {"attention_bias": model.add_bias_linear, "mlp_bias": model.add_bias_linear, "pretraining_tp": 1}


def _qwen_window(model: ModelConfig) -> dict[str, Any]:
    """Qwen2's and Qwen3's window fields: `layer_types` names each layer's attention (transformers >= 4.53 reads
    it); `max_window_layers` counts the full-attention layers before the first sliding one (what older releases
    read, exact when the sliding layers are the last ones)."""
    if model.window_size is None:
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": model.num_layers}
    kinds = ["full_attention" if w is None else "sliding_attention" for w in model.layer_windows]
    return {
        "use_sliding_window": True,
        "sliding_window": _sliding_window(model),
        "max_window_layers": kinds.index("sliding_attention"),
        "layer_types": kinds,
    }


def export_notes(arch: str, model: ModelConfig) -> list[str]:
    """What a reader of the exported config.json may take differently, one line each: Qwen2's and Qwen3's sliding
    layers when they are not the last ones, which `max_window_layers` (all that transformers before 4.53 reads)
    cannot say; how Mixtral's or Qwen3-MoE's router differs from the training gate's (`_expert_notes`)."""
    if arch in (MIXTRAL, QWEN3_MOE, QWEN2_MOE):
        return _expert_notes(model, {MIXTRAL: "Mixtral", QWEN3_MOE: "Qwen3-MoE", QWEN2_MOE: "Qwen2-MoE"}[arch])
    if arch not in (QWEN2, QWEN3) or model.window_size is None:
        return []
    sliding = [i for i, w in enumerate(model.layer_windows) if w is not None]
    if sliding == list(range(sliding[0], model.num_layers)):
        return []
    return [
        f"the sliding-window layers are {sliding} of 0..{model.num_layers - 1}, which config.json's layer_types "
        f"names and transformers 4.53 or newer reads; older releases read only max_window_layers {sliding[0]} and "
        f"would slide every layer from {sliding[0]} on: load it with transformers >= 4.53"
    ]


def _expert_notes(model: ModelConfig, title: str) -> list[str]:
    """Mixtral and Qwen3-MoE route every token to its k best experts: what the training gate did otherwise, and the
    load-balancing loss transformers computes with `output_router_logits` (DeepSpeed's top-2 gate counts a token's
    first expert only, transformers' all k)."""
    notes, k = [], model.moe_top_k
    if model.moe_token_dropping:
        notes.append(
            f"training dropped the tokens over each expert's capacity (--moe-train-capacity-factor "
            f"{model.moe_train_capacity_factor:g}); {title}, like tools/generate.py, routes every token to its {k} "
            f"experts (--disable-moe-token-dropping trains that way)"
        )
    if model.moe_top2_2nd_expert_sampling:
        notes.append(
            f"training sampled each token's second expert (top-2's Gumbel sampling); {title}, like tools/generate.py, "
            "takes the second best (--disable-moe-top2-2nd-expert-sampling trains that way)"
        )
    return [*notes, moe_loss_note(model)]


def moe_loss_note(model: ModelConfig) -> str:
    """How `router_aux_loss_coef` (written and read as the coefficient flag) weighs another load-balancing loss: ours
    adds every MoE layer's loss (about 1 each when balanced; DeepSpeed's gates count a token's first expert, Megatron-LM's
    router all k, divided by k), transformers' (`output_router_logits`) one averaged over the layers (about k; all k
    experts counted)."""
    layers, k = sum(1 for n in model.experts_per_layer if n > 1), model.moe_top_k
    megatron = model.moe_router == "megatron"
    flag, gate = ("--moe-aux-loss-coeff", "Megatron-LM") if megatron else ("--moe-loss-coeff", "DeepSpeed")
    counted = f"all {k} experts counted" if megatron else "a token's first expert counted"
    return (
        f"router_aux_loss_coef is {flag} {model.moe_loss_coeff:g}, but the losses differ: ours sums each of the "
        f"{layers} MoE layers' {gate} load-balancing loss (about 1 per layer when balanced, {counted}), transformers' "
        f"averages one over the layers (about {k} in all, all {k} experts counted): at one coefficient ours weighs "
        f"balancing about {layers / k:.3g} x as much"
    )


def _llama_layout_fields(model: ModelConfig, regularization: RegularizationConfig) -> dict[str, Any]:
    return {
        "num_hidden_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "intermediate_size": model.ffn_hidden_size,
        "max_position_embeddings": model.max_position_embeddings,
        "hidden_act": activations.find(model.activation).hf_names[0],
        "rms_norm_eps": model.layernorm_epsilon,
        "rope_theta": model.rotary_base,
        "rope_scaling": _llama3_scaling(model),
        "attention_dropout": regularization.attention_dropout,
    }


def _llama3_scaling(model: ModelConfig) -> dict[str, Any] | None:
    """transformers' `rope_scaling` of a Llama 3.x-scaled model (None without scaling)."""
    if not model.use_rope_scaling:
        return None
    return {"rope_type": "llama3", "factor": model.rope_scaling_factor, **LLAMA3_ROPE_SCALING}


def _phi3_fields(model: ModelConfig, regularization: RegularizationConfig) -> dict[str, Any]:
    return {
        "num_hidden_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.kv_heads,
        "intermediate_size": model.ffn_hidden_size,
        "max_position_embeddings": model.max_position_embeddings,
        "original_max_position_embeddings": model.max_position_embeddings,
        "hidden_act": activations.find(model.activation).hf_names[0],
        "rms_norm_eps": model.layernorm_epsilon,
        "rope_theta": model.rotary_base,
        "partial_rotary_factor": model.rotary_percent,
        "rope_scaling": None,
        "sliding_window": _sliding_window(model),  # every layer's
        "resid_pdrop": regularization.hidden_dropout,
        "embd_pdrop": regularization.hidden_dropout,
        "attention_dropout": regularization.attention_dropout,
        "pad_token_id": None,  # Phi-3's default (32000) would name a row the embedding may not have
    }
