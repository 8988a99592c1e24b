"""Our ModelConfig -> a Hugging Face `config.json`, one table per architecture (reading one back:
`hf_config_read.py`).

GPT-2 (`GPT2LMHeadModel`): LayerNorm, a GeLU (tanh `gelu_new` or exact `gelu`), learned positions,
biases, multi-head attention. Llama (`LlamaForCausalLM`): RMSNorm, SwiGLU, rotary embeddings (any
`rope_theta`) on whole heads, optional grouped-query attention and biases. Qwen2 (`Qwen2ForCausalLM`): Llama
with q/k/v biases alone (our `--add-qkv-bias`). Qwen3 (`Qwen3ForCausalLM`): Llama without biases, with an RMSNorm
on each query and key head (our `--qk-layernorm`). Their `head_dim` is our `--kv-channels` (hidden_size /
num_attention_heads when absent, Qwen3's 128). Mistral (`MistralForCausalLM`): Llama without biases, written
only on request (`--hf-model-type mistral`) or for a model with a sliding window on every layer. Sliding windows
are Megatron-LM's `--window-size LEFT,0` with transformers' `sliding_window` LEFT + 1 (a key k is seen by the query
q when q - sliding_window < k <= q): Mistral's on every layer, Qwen2's and Qwen3's with `use_sliding_window` on the
layers `layer_types` names `sliding_attention` (`--window-attn-skip-freq`'s pattern), Phi-3's on every layer (its
`sliding_window`, transformers' mask as Mistral's; absent or null: none). Mixtral (`MixtralForCausalLM`): Mistral's
layer with a mixture of SwiGLU experts on every layer (our `--num-experts N --expert-interval 1 --topk 2`): its router
is DeepSpeed's top-2 gate computed without capacity (softmax over the experts, the two best renormalized), as our
inference routes (`moe.route_every_token`). Phi-3 (`Phi3ForCausalLM`):
Llama's layer without biases, with fused q|k|v and gate|up tensors and partial rotary embeddings
(`partial_rotary_factor`, our `--rotary-percent`: the Llama-like models whose rotary share is below
1 export as Phi-3, since transformers' Llama rotates whole heads). Each may tie or untie its LM head
(`tie_word_embeddings`). Activation names come from `megatron_ds.model.activations` (`hf_names`),
each architecture's norm from `megatron_ds.model.norms` (`hf_model_types`).

A model the target cannot express exactly is a `HFConfigError` naming our flag; a `config.json`
option we do not build is one naming its field. Nothing here imports transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.config.model import LLAMA3_ROPE_SCALING
from megatron_ds.errors import UserError
from megatron_ds.model import activations, norms

GPT2, LLAMA, QWEN2, QWEN3, MISTRAL, PHI3 = "gpt2", "llama", "qwen2", "qwen3", "mistral", "phi3"
MIXTRAL = "mixtral"
ARCHITECTURE_CLASSES = {
    GPT2: "GPT2LMHeadModel",
    LLAMA: "LlamaForCausalLM",
    QWEN2: "Qwen2ForCausalLM",
    QWEN3: "Qwen3ForCausalLM",
    MISTRAL: "MistralForCausalLM",
    PHI3: "Phi3ForCausalLM",
    MIXTRAL: "MixtralForCausalLM",
}
LLAMA_LAYOUT = (LLAMA, QWEN2, QWEN3, MISTRAL)
"""Llama's layer and tensor names: Qwen2 adds q/k/v biases (our --add-qkv-bias), Qwen3 query and key norms (our
--qk-layernorm), Mistral a sliding window."""

GPT2_NORM, LLAMA_NORM = norms.for_hf_model_type(GPT2), norms.for_hf_model_type(LLAMA)
assert all(norms.for_hf_model_type(t) is LLAMA_NORM for t in LLAMA_LAYOUT)
PHI3_NORM = norms.for_hf_model_type(PHI3)
"""The norm each architecture is built with (LayerNorm, RMSNorm, RMSNorm)."""


class HFConfigError(UserError):
    """A model or `config.json` that has no exact counterpart on the other side."""


@dataclass(frozen=True)
class Requirement:
    """A ModelConfig value an architecture needs; `problem` names our flag and why it cannot be exported."""

    holds: Callable[[ModelConfig], bool]
    problem: str | Callable[[ModelConfig], str]
    """The text, or a function of the model when the text names the value given."""


def _norm_requirement(norm: norms.Norm, architecture: str) -> Requirement:
    """The architecture is built with `norm` alone; the problem names the norm given instead."""
    return Requirement(
        lambda m: m.normalization == norm.name,
        lambda m: f"--normalization {m.normalization}: {architecture} uses {norm.title}",
    )


GPT2_REQUIRES = (
    _norm_requirement(GPT2_NORM, "GPT-2"),
    Requirement(
        lambda m: not m.use_rotary_position_embeddings,
        "--use-rotary-position-embeddings: GPT-2 has learned positions only (rotary models export as Llama, "
        "which also needs --swiglu)",
    ),
    Requirement(lambda m: m.add_position_embedding, "--no-position-embedding: GPT-2 adds learned positions"),
    Requirement(lambda m: m.add_bias_linear, "--disable-bias-linear: GPT-2 has a bias in every linear layer"),
    Requirement(
        lambda m: m.kv_heads == m.num_attention_heads, "--num-key-value-heads: GPT-2 has no grouped-query attention"
    ),
    Requirement(
        lambda m: m.kv_channels is None,
        lambda m: f"--kv-channels {m.kv_channels}: GPT-2's head size is n_embd / n_head ({_default_head(m)})",
    ),
)
LLAMA_REQUIRES = (
    _norm_requirement(LLAMA_NORM, "Llama"),
    Requirement(
        lambda m: m.use_rotary_position_embeddings, "no --use-rotary-position-embeddings: Llama needs rotary embeddings"
    ),
    Requirement(lambda m: not m.add_position_embedding, "learned position embeddings: Llama has none"),
)
PHI3_REQUIRES = (
    _norm_requirement(PHI3_NORM, "Phi-3"),
    Requirement(
        lambda m: m.kv_channels is None,
        lambda m: (
            f"--kv-channels {m.kv_channels} with --rotary-percent {m.rotary_percent:g}: partial rotary exports as "
            f"Phi-3, whose config has no head_dim (its head size is hidden_size / num_attention_heads, "
            f"{_default_head(m)})"
        ),
    ),
    Requirement(
        lambda m: m.window_attn_skip_freq is None,
        "--window-attn-skip-freq with --rotary-percent below 1: partial rotary exports as Phi-3, whose sliding window "
        "is on every layer",
    ),
    Requirement(
        lambda m: not m.use_rope_scaling,
        "--use-rope-scaling with --rotary-percent below 1: partial rotary exports as Phi-3, whose rope scaling is "
        "not Llama 3.x's",
    ),
    Requirement(
        lambda m: not m.add_bias_linear,
        lambda m: (
            f"biases with --rotary-percent {m.rotary_percent:g}: partial rotary exports as Phi-3, which has no "
            f"biases (transformers' Llama, which has them, rotates whole heads)"
        ),
    ),
)


MISTRAL_REQUIRES = (
    Requirement(lambda m: not m.add_bias_linear, "biases (no --disable-bias-linear): Mistral has none"),
    Requirement(
        lambda m: m.window_attn_skip_freq is None,
        "--window-attn-skip-freq: Mistral's sliding window is on every layer (Qwen2 and Qwen3 name the layers)",
    ),
    Requirement(lambda m: not m.add_qkv_bias, "--add-qkv-bias: Mistral has no biases (Qwen2 has this one)"),
)
QWEN2_REQUIRES = (
    Requirement(
        lambda m: m.add_qkv_bias,
        lambda m: (
            "no --add-qkv-bias: Qwen2 has q/k/v biases"
            + (" and no others" if m.add_bias_linear else " (a model without biases exports as llama or mistral)")
        ),
    ),
)


QWEN3_REQUIRES = (
    Requirement(lambda m: m.qk_layernorm, "no --qk-layernorm: Qwen3 has query and key norms"),
    Requirement(
        lambda m: not m.add_bias_linear,
        "biases (no --disable-bias-linear): Qwen3's attention_bias puts them on q, k, v and o alone, none in the MLP",
    ),
    Requirement(
        lambda m: m.rotary_percent == 1.0,
        lambda m: f"--rotary-percent {m.rotary_percent:g}: Qwen3 rotates whole heads",
    ),
)


MIXTRAL_REQUIRES = (
    Requirement(
        lambda m: m.gated_mlp,
        lambda m: f"experts with a {m.activation} MLP: Mixtral's experts are SwiGLU (--swiglu)",
    ),
    Requirement(
        lambda m: len(set(m.experts_per_layer)) == 1,
        lambda m: (
            f"--num-experts {' '.join(map(str, m.num_experts))} --expert-interval {m.expert_interval} (experts per "
            f"layer {list(m.experts_per_layer)}): Mixtral has the same experts on every layer (--expert-interval 1, "
            f"one --num-experts)"
        ),
    ),
    Requirement(
        lambda m: m.moe_top_k == 2,
        lambda m: (
            f"--topk {m.moe_top_k}: Mixtral weighs a token's experts by their renormalized scores (at top-1 a weight "
            f"of 1, where DeepSpeed's top-1 gate weighs by the softmax score); only --topk 2 is the same"
        ),
    ),
    Requirement(lambda m: m.mlp_type == "standard", "--mlp-type residual: Mixtral has no residual MLP (PR-MoE)"),
    Requirement(lambda m: not m.add_bias_linear, "biases (no --disable-bias-linear): Mixtral has none"),
    Requirement(
        lambda m: m.rotary_percent == 1.0,
        lambda m: f"--rotary-percent {m.rotary_percent:g}: Mixtral rotates whole heads",
    ),
    Requirement(lambda m: not m.use_rope_scaling, "--use-rope-scaling: Mixtral's config has no Llama 3.x rope scaling"),
    Requirement(
        lambda m: m.window_attn_skip_freq is None,
        "--window-attn-skip-freq: Mixtral's sliding window is on every layer",
    ),
)
"""A mixture-of-experts model is Mixtral's when its experts are (DeepSpeed's top-2 gate without capacity is Mixtral's
router; `moe.route_every_token`)."""


def _default_head(model: ModelConfig) -> str:
    """hidden / heads as a head size, or the fraction when it is none."""
    h, heads = model.hidden_size, model.num_attention_heads
    return str(h // heads) if h % heads == 0 else f"{h}/{heads}, not an integer"


_TYPE_REQUIRES = {MISTRAL: MISTRAL_REQUIRES, QWEN2: QWEN2_REQUIRES, QWEN3: QWEN3_REQUIRES}
"""What a Llama-layout type asked for by --hf-model-type needs beyond Llama's."""
_QKV_BIAS_IS_QWEN2S = Requirement(
    lambda m: not m.add_qkv_bias, "--add-qkv-bias: of these types only Qwen2 (Llama's layout with --swiglu) has it"
)
_WINDOW_IS_NOT_HERE = Requirement(
    lambda m: m.window_size is None,
    "--window-size: this type has no sliding window here (Mistral and Phi-3 have one on every layer, Qwen2 and Qwen3 "
    "on the layers they name)",
)
WINDOWED = (QWEN2, QWEN3, MISTRAL, PHI3, MIXTRAL)
"""The types whose config.json holds a sliding window."""
_QK_NORM_IS_QWEN3S = Requirement(
    lambda m: not m.qk_layernorm,
    "--qk-layernorm: of these types only Qwen3 (Llama's layout with --swiglu, no biases) has query and key norms",
)

_NO_QK_L2_NORM = Requirement(
    lambda m: not m.qk_l2_norm,
    "--qk-l2-norm: no type here has a weightless norm on every layer's query and key heads (Llama 4's is on its "
    "rotary layers only, of a mixture-of-experts model with interleaved rotary)",
)


def architecture_of(model: ModelConfig, model_type: str | None = None) -> str:
    """GPT2, LLAMA, QWEN2, QWEN3, PHI3 or MIXTRAL (experts) for a model both sides express exactly (a QKV bias alone is
    Qwen2's, query and key norms Qwen3's), or
    `model_type` when asked for and exact (MISTRAL: a Llama without biases); HFConfigError naming the first
    obstacle."""
    if model.is_moe:
        arch, requires = MIXTRAL, LLAMA_REQUIRES + MIXTRAL_REQUIRES
    elif model.gated_mlp and model.qk_layernorm:
        arch, requires = QWEN3, LLAMA_REQUIRES + QWEN3_REQUIRES
    elif model.gated_mlp and model.rotary_percent < 1.0:
        arch, requires = PHI3, LLAMA_REQUIRES[1:] + PHI3_REQUIRES
    elif model.gated_mlp and model.add_qkv_bias:
        arch, requires = QWEN2, LLAMA_REQUIRES
    elif model.gated_mlp and model.window_size is not None:  # Llama has no window; Mistral is Llama with one
        arch, requires = MISTRAL, LLAMA_REQUIRES + MISTRAL_REQUIRES
    elif model.gated_mlp:
        arch, requires = LLAMA, LLAMA_REQUIRES
    else:
        arch, requires = GPT2, GPT2_REQUIRES
    if model_type is not None and model_type != arch:
        _check_model_type(model_type, arch)
        arch = model_type
        requires = (*requires, *_TYPE_REQUIRES.get(arch, ()))
    if arch not in (QWEN2, MISTRAL):
        requires = (*requires, _QKV_BIAS_IS_QWEN2S)
    if arch != QWEN3:
        requires = (*requires, _QK_NORM_IS_QWEN3S)
    if arch not in WINDOWED:
        requires = (*requires, _WINDOW_IS_NOT_HERE)
    requires = (_NO_QK_L2_NORM, *requires)
    for r in requires:
        if not r.holds(model):
            problem = r.problem(model) if callable(r.problem) else r.problem
            raise HFConfigError(f"cannot export to Hugging Face {arch}: {problem}; no exact equivalent exists")
    return arch


def _check_model_type(model_type: str, arch: str) -> None:
    """A model of `arch` may be written as another Llama-layout type (checked by that type's requirements)."""
    if model_type not in ARCHITECTURE_CLASSES:
        raise HFConfigError(f"--hf-model-type {model_type}: choose one of {', '.join(ARCHITECTURE_CLASSES)}")
    if model_type not in LLAMA_LAYOUT or arch not in LLAMA_LAYOUT:
        raise HFConfigError(
            f"--hf-model-type {model_type}: the checkpoint's model exports as {arch} only; drop --hf-model-type"
        )


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
    if arch == MIXTRAL:
        return {**common, **_llama_layout_fields(model, regularization), **_mixtral_fields(model)}
    return {**common, **_llama_layout_fields(model, regularization), **_type_fields(arch, model)}


def _mixtral_fields(model: ModelConfig) -> dict[str, Any]:
    """Mixtral's experts, its router (top-2, no jitter) and its window (on every layer, MIXTRAL_REQUIRES)."""
    return {
        "num_local_experts": model.experts_per_layer[0],
        "num_experts_per_tok": model.moe_top_k,
        "router_aux_loss_coef": model.moe_loss_coeff,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
        "sliding_window": None if model.window_size is None else model.window_size[0] + 1,
    }


def _type_fields(arch: str, model: ModelConfig) -> dict[str, Any]:
    """What Llama, Qwen2, Qwen3 and Mistral's config.json say differently: biases, and the sliding window."""
    if arch == QWEN2:  # q/k/v biases are built in
        return _qwen_window(model)
    if arch == QWEN3:  # q/k norms are built in; attention_bias would add o_proj's too
        return {**_qwen_window(model), "attention_bias": False}
    if arch == MISTRAL:  # on every layer (MISTRAL_REQUIRES)
        return {"sliding_window": None if model.window_size is None else model.window_size[0] + 1}
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
        "sliding_window": model.window_size[0] + 1,
        "max_window_layers": kinds.index("sliding_attention"),
        "layer_types": kinds,
    }


def export_notes(arch: str, model: ModelConfig) -> list[str]:
    """What a reader of the exported config.json may take differently, one line each: Qwen2's and Qwen3's sliding
    layers when they are not the last ones, which `max_window_layers` (all that transformers before 4.53 reads)
    cannot say; how Mixtral's router differs from the training gate's (`_mixtral_notes`)."""
    if arch == MIXTRAL:
        return _mixtral_notes(model)
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


def _mixtral_notes(model: ModelConfig) -> list[str]:
    """Mixtral routes every token to its two best experts: what the training gate did otherwise, and the load-balancing
    loss transformers computes with `output_router_logits` (DeepSpeed's top-2 gate counts a token's first expert only,
    transformers' both)."""
    notes = []
    if model.moe_token_dropping:
        notes.append(
            f"training dropped the tokens over each expert's capacity (--moe-train-capacity-factor "
            f"{model.moe_train_capacity_factor:g}); Mixtral, like tools/generate.py, routes every token to its two "
            f"experts (--disable-moe-token-dropping trains that way)"
        )
    if model.moe_top2_2nd_expert_sampling:
        notes.append(
            "training sampled each token's second expert (top-2's Gumbel sampling); Mixtral, like tools/generate.py, "
            "takes the second best (--disable-moe-top2-2nd-expert-sampling trains that way)"
        )
    notes.append(
        f"router_aux_loss_coef is --moe-loss-coeff {model.moe_loss_coeff:g}; transformers' load-balancing loss "
        f"(output_router_logits) counts both experts of a token, DeepSpeed's top-2 gate the first alone"
    )
    return notes


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
        "sliding_window": None if model.window_size is None else model.window_size[0] + 1,  # every layer's
        "resid_pdrop": regularization.hidden_dropout,
        "embd_pdrop": regularization.hidden_dropout,
        "attention_dropout": regularization.attention_dropout,
        "pad_token_id": None,  # Phi-3's default (32000) would name a row the embedding may not have
    }
