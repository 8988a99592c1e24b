"""Which Hugging Face architecture our model is (`architecture_of`), and what each requires of it: one table of
`Requirement`s per architecture, each naming our flag when the model breaks it. Writing the `config.json` is
`hf_config.py`, reading one back `hf_config_read.py`, the tensor names `hf_weights.py`.

GPT-2 (`GPT2LMHeadModel`): LayerNorm, a GeLU (tanh `gelu_new` or exact `gelu`), learned positions, biases, multi-head
attention. Llama (`LlamaForCausalLM`): RMSNorm, SwiGLU, rotary embeddings (any `rope_theta`) on whole heads, optional
grouped-query attention and biases. Qwen2: Llama with q/k/v biases alone (our `--add-qkv-bias`). Qwen3: Llama without
biases, with an RMSNorm on each query and key head (our `--qk-layernorm`). Mistral: Llama without biases, written only
on request (`--hf-model-type mistral`) or for a model with a sliding window on every layer. Phi-3: Llama's layer
without biases, with partial rotary embeddings (our `--rotary-percent` below 1). Mixtral: Mistral's layer with a
mixture of SwiGLU experts on every layer (our `--num-experts N --expert-interval 1 --topk 2`, or Megatron-LM's router at
any `--moe-router-topk`). Qwen3-MoE: Qwen3's layer with Mixtral's experts (`norm_topk_prob`). Qwen2-MoE: Qwen2's layer
with those experts and a gated shared expert (`--moe-shared-expert-intermediate-size N --moe-shared-expert-gate`),
`norm_topk_prob` false being `--moe-router-pre-softmax`. Each may tie or untie its
LM head. Each architecture's norm comes from `megatron_ds.model.norms`. Nothing here imports transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_ds.config import ModelConfig
from megatron_ds.errors import UserError
from megatron_ds.model import norms

GPT2, LLAMA, QWEN2, QWEN3, MISTRAL, PHI3 = "gpt2", "llama", "qwen2", "qwen3", "mistral", "phi3"
MIXTRAL, QWEN3_MOE, QWEN2_MOE = "mixtral", "qwen3_moe", "qwen2_moe"
EXPERTS = (MIXTRAL, QWEN3_MOE, QWEN2_MOE)
"""The types with a mixture of experts on every layer."""
ARCHITECTURE_CLASSES = {
    GPT2: "GPT2LMHeadModel",
    LLAMA: "LlamaForCausalLM",
    QWEN2: "Qwen2ForCausalLM",
    QWEN3: "Qwen3ForCausalLM",
    MISTRAL: "MistralForCausalLM",
    PHI3: "Phi3ForCausalLM",
    MIXTRAL: "MixtralForCausalLM",
    QWEN3_MOE: "Qwen3MoeForCausalLM",
    QWEN2_MOE: "Qwen2MoeForCausalLM",
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


def _expert_requires(title: str, shared: bool = False, pre_softmax: bool = False) -> tuple[Requirement, ...]:
    """What `title` (Mixtral, Qwen3-MoE; Qwen2-MoE, `shared`) needs of a mixture of experts: the same SwiGLU experts on
    every layer, the router's weights renormalized over the k chosen (either way where `title` has `norm_topk_prob`:
    `shared` or `pre_softmax`), no biases, whole heads rotated, a window on all layers or none; no shared expert
    (Qwen2-MoE: a gated one)."""
    kind = _gated_shared_expert(title) if shared else _no_shared_expert(title, pre_softmax)
    return (*kind, *_common_expert_requires(title))


def _no_shared_expert(title: str, pre_softmax: bool) -> tuple[Requirement, ...]:
    """No shared expert; `--moe-router-pre-softmax` only where `pre_softmax` (`norm_topk_prob` false expresses it)."""
    return (
        Requirement(
            lambda m: not m.moe_router_pre_softmax or pre_softmax,
            f"--moe-router-pre-softmax: {title} renormalizes a token's k weights over the k chosen (train without it)",
        ),
        Requirement(
            lambda m: not m.moe_shared_expert_size,
            lambda m: (
                f"--moe-shared-expert-intermediate-size {m.moe_shared_expert_size}: {title} has no shared expert "
                "(Qwen2-MoE, without query and key norms, has a gated one)"
            ),
        ),
    )


def _gated_shared_expert(title: str) -> tuple[Requirement, ...]:
    return (
        Requirement(
            lambda m: m.moe_shared_expert_gate,
            f"--moe-shared-expert-intermediate-size without --moe-shared-expert-gate: {title}'s shared expert is gated",
        ),
    )


def _common_expert_requires(title: str) -> tuple[Requirement, ...]:
    return (
        Requirement(
            lambda m: m.gated_mlp,
            lambda m: f"experts with a {m.activation} MLP: {title}'s experts are SwiGLU (--swiglu)",
        ),
        Requirement(
            lambda m: len(set(m.experts_per_layer)) == 1,
            lambda m: (
                f"--num-experts {' '.join(map(str, m.num_experts))} --expert-interval {m.expert_interval} (experts per "
                f"layer {list(m.experts_per_layer)}): {title} has the same experts on every layer (--expert-interval "
                f"1, one --num-experts)"
            ),
        ),
        Requirement(
            lambda m: m.moe_top_k == 2 or m.moe_router == "megatron",
            lambda m: (
                f"--topk {m.moe_top_k}: {title} weighs a token's experts by their renormalized scores (at top-1 a "
                f"weight of 1, where DeepSpeed's top-1 gate weighs by the softmax score); of DeepSpeed's gates only "
                f"--topk 2 is the same (Megatron-LM's router, --moe-router-topk K, is at any K)"
            ),
        ),
        Requirement(lambda m: m.mlp_type == "standard", f"--mlp-type residual: {title} has no residual MLP (PR-MoE)"),
        Requirement(
            lambda m: not m.add_bias_linear,
            f"biases (no --disable-bias-linear): {title} has none"
            + (" but on q, k and v (--add-qkv-bias)" if title == "Qwen2-MoE" else ""),
        ),
        Requirement(
            lambda m: m.rotary_percent == 1.0,
            lambda m: f"--rotary-percent {m.rotary_percent:g}: {title} rotates whole heads",
        ),
        Requirement(
            lambda m: m.window_attn_skip_freq is None,
            f"--window-attn-skip-freq: {title}'s sliding window is on every layer",
        ),
    )


MIXTRAL_REQUIRES = _expert_requires("Mixtral")
"""A mixture-of-experts model is Mixtral's when its experts are: the same SwiGLU experts on every layer, no shared
expert, routed with the k chosen weights renormalized over the k (DeepSpeed's top-2 gate without capacity,
`moe.route_every_token`, or Megatron-LM's top-k router, `moe.megatron_router`, at any k without
`--moe-router-pre-softmax`)."""
QWEN3_MOE_REQUIRES = _expert_requires("Qwen3-MoE", pre_softmax=True)
"""Qwen3-MoE's (beside query and key norms, `QWEN3_REQUIRES`): Mixtral's experts, routed as Mixtral's
(`norm_topk_prob` true) or by Megatron-LM's router with `--moe-router-pre-softmax` (`norm_topk_prob` false: the k
largest of the softmax over all experts, not renormalized)."""
QWEN2_MOE_REQUIRES = (
    *_expert_requires("Qwen2-MoE", shared=True),
    Requirement(lambda m: m.add_qkv_bias, "no --add-qkv-bias: Qwen2-MoE has q/k/v biases (qkv_bias), as Qwen2"),
)
"""Qwen2-MoE: Qwen2's layer (q/k/v biases) with experts on every layer and a gated shared expert beside them
(`moe.SharedExpert`), routed by Megatron-LM's top-k router with (`norm_topk_prob` true) or without
(`--moe-router-pre-softmax`, its default false) renormalization; no sliding window here."""


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
WINDOWED = (QWEN2, QWEN3, MISTRAL, PHI3, MIXTRAL, QWEN3_MOE)
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
    """GPT2, LLAMA, QWEN2, QWEN3, PHI3, MIXTRAL, QWEN3_MOE or QWEN2_MOE (experts) for a model both sides express exactly
    (a QKV bias alone is Qwen2's, query and key norms Qwen3's and, with experts, Qwen3-MoE's; a shared expert
    Qwen2-MoE's), or
    `model_type` when asked for and exact (MISTRAL: a Llama without biases); HFConfigError naming the first
    obstacle."""
    if model.is_moe and model.qk_layernorm:
        arch, requires = QWEN3_MOE, LLAMA_REQUIRES + QWEN3_MOE_REQUIRES + QWEN3_REQUIRES
    elif model.is_moe and model.moe_shared_expert_size:
        arch, requires = QWEN2_MOE, LLAMA_REQUIRES + QWEN2_MOE_REQUIRES
    elif model.is_moe:
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
    if arch not in (QWEN2, MISTRAL, QWEN2_MOE):
        requires = (*requires, _QKV_BIAS_IS_QWEN2S)
    if arch not in (QWEN3, QWEN3_MOE):
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
