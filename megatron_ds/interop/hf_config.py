"""Our ModelConfig <-> a Hugging Face `config.json`, one table per architecture.

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
`sliding_window`, transformers' mask as Mistral's; absent or null: none). Phi-3 (`Phi3ForCausalLM`):
Llama's layer without biases, with fused q|k|v and gate|up tensors and partial rotary embeddings
(`partial_rotary_factor`, our `--rotary-percent`: the Llama-like models whose rotary share is below
1 export as Phi-3, since transformers' Llama rotates whole heads). Each may tie or untie its LM head
(`tie_word_embeddings`). Activation names come from `megatron_ds.model.activations` (`hf_names`),
each architecture's norm from `megatron_ds.model.norms` (`hf_model_types`).

A model the target cannot express exactly is a `HFConfigError` naming our flag; a `config.json`
option we do not build is one naming its field. Nothing here imports transformers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.config.model import DEFAULT_ROTARY_BASE, LLAMA3_ROPE_SCALING
from megatron_ds.errors import UserError
from megatron_ds.flags.to_config import ACTIVATION_FLAGS
from megatron_ds.model import activations, norms

GPT2, LLAMA, QWEN2, QWEN3, MISTRAL, PHI3 = "gpt2", "llama", "qwen2", "qwen3", "mistral", "phi3"
ARCHITECTURE_CLASSES = {
    GPT2: "GPT2LMHeadModel",
    LLAMA: "LlamaForCausalLM",
    QWEN2: "Qwen2ForCausalLM",
    QWEN3: "Qwen3ForCausalLM",
    MISTRAL: "MistralForCausalLM",
    PHI3: "Phi3ForCausalLM",
}
LLAMA_LAYOUT = (LLAMA, QWEN2, QWEN3, MISTRAL)
"""Llama's layer and tensor names: Qwen2 adds q/k/v biases (our --add-qkv-bias), Qwen3 query and key norms (our
--qk-layernorm), Mistral a sliding window."""

GPT2_ACTIVATIONS: dict[str, str] = {
    hf: a.name for a in activations.REGISTRY.values() if not a.gated for hf in a.hf_names
}
"""GPT-2's `activation_function` -> our activation: `gelu_new` (GPT-2's default), `gelu_pytorch_tanh`
and `gelu_fast` are the tanh form, `gelu` the exact one."""
LLAMA_ACTIVATIONS: dict[str, str] = {hf: a.name for a in activations.REGISTRY.values() if a.gated for hf in a.hf_names}
"""Llama's `hidden_act` (the gate's function) -> our gated activation."""
GPT2_NORM, LLAMA_NORM = norms.for_hf_model_type(GPT2), norms.for_hf_model_type(LLAMA)
assert all(norms.for_hf_model_type(t) is LLAMA_NORM for t in LLAMA_LAYOUT)
PHI3_NORM = norms.for_hf_model_type(PHI3)
"""The norm each architecture is built with (LayerNorm, RMSNorm, RMSNorm)."""


TRANSFORMERS_SLIDING_WINDOW = 4096
"""MistralConfig's, Qwen2Config's and Qwen3Config's `sliding_window` when config.json has no such key."""
QWEN3_DEFAULT_HEAD_DIM = 128
"""transformers' Qwen3Config `head_dim` when config.json has none (whatever hidden_size / num_attention_heads is)."""


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
WINDOWED = (QWEN2, QWEN3, MISTRAL, PHI3)
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
    """GPT2, LLAMA, QWEN2, QWEN3 or PHI3 for a model both sides express exactly (a QKV bias alone is Qwen2's, query
    and key norms Qwen3's), or
    `model_type` when asked for and exact (MISTRAL: a Llama without biases); HFConfigError naming the first
    obstacle."""
    if model.gated_mlp and model.qk_layernorm:
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
    return {**common, **_llama_layout_fields(model, regularization), **_type_fields(arch, model)}


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
    cannot say."""
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


@dataclass
class HFModel:
    """What a Hugging Face `config.json` says, in our terms."""

    arch: str
    architecture: dict[str, Any]
    """argparse dests of pretrain_gpt.py -> values that fix the weights; flags given with other values are errors."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """Dests taken from config.json that flags may change (dropout, init std, sequence length)."""
    vocab_size: int = 0
    """Rows of the Hugging Face vocabulary (ours is padded from this)."""


def from_hf_config(hf: dict[str, Any], source: str) -> HFModel:
    """Read a `config.json` of a type in ARCHITECTURE_CLASSES (already parsed); HFConfigError names an unsupported
    field."""
    reader = _Fields(hf, source)
    model_type = reader.get("model_type", str, None)
    if model_type not in ARCHITECTURE_CLASSES:
        archs = hf.get("architectures")
        known = ", ".join(f"{t} ({c})" for t, c in ARCHITECTURE_CLASSES.items())
        raise HFConfigError(
            f"{source}: model_type {model_type!r} (architectures {archs}) is not supported; only {known} convert "
            f"exactly"
        )
    quantized = hf.get("quantization_config")
    if quantized:  # GPTQ, AWQ, bitsandbytes, fp8: the stored tensors are not the weights
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else quantized
        raise HFConfigError(
            f"{source}: quantization_config ({method}): a quantized model does not convert; give its unquantized "
            f"weights (the original release, or the model dequantized and saved with save_pretrained)"
        )
    if model_type in LLAMA_LAYOUT:
        return _from_llama(reader, model_type)
    return {GPT2: _from_gpt2, PHI3: _from_phi3}[model_type](reader)


class _Fields:
    """Typed access to config.json fields with one-line errors naming the field."""

    def __init__(self, hf: dict[str, Any], source: str) -> None:
        self.hf, self.source = hf, source

    def get(self, name: str, kind: type, default: Any = ...) -> Any:
        if name not in self.hf or self.hf[name] is None:
            if default is ...:
                raise HFConfigError(f"{self.source}: no {name!r} field; the config.json is incomplete")
            return default
        value = self.hf[name]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise HFConfigError(f"{self.source}: {name} {value!r} is not a{'n' if kind is int else ''} {kind.__name__}")
        return value

    def size(self, name: str, default: Any = ...) -> int:
        """An int field that counts something (layers, heads, widths, rows): 0 or less is a damaged config.json,
        named here rather than as the pretrain_gpt.py flag it becomes."""
        value = self.get(name, int, default)
        if value < 1:
            raise HFConfigError(f"{self.source}: {name} {value} must be >= 1; fix the config.json")
        return value

    def require(self, name: str, allowed: Sequence[Any], default: Any, why: str) -> Any:
        value = self.hf.get(name, default)
        if value not in allowed:
            raise HFConfigError(f"{self.source}: {name} {value!r} is not supported: {why}")
        return value


def _from_gpt2(f: _Fields) -> HFModel:
    act = f.require(
        "activation_function",
        tuple(GPT2_ACTIVATIONS),
        "gelu_new",
        f"the GeLUs built are {', '.join(GPT2_ACTIVATIONS)}",
    )
    f.require("scale_attn_weights", (True,), True, "attention is always scaled by 1/sqrt(head size)")
    f.require("scale_attn_by_inverse_layer_idx", (False,), False, "no per-layer attention scaling is built")
    f.require("add_cross_attention", (False,), False, "a decoder-only GPT has no cross-attention")
    h = f.size("n_embd")
    architecture = {
        "num_layers": f.size("n_layer"),
        "hidden_size": h,
        "num_attention_heads": f.size("n_head"),
        "ffn_hidden_size": f.size("n_inner", 4 * h),
        "max_position_embeddings": f.size("n_positions"),
        "layernorm_epsilon": f.get("layer_norm_epsilon", float, 1e-5),
        "normalization": GPT2_NORM.name,
        "num_key_value_heads": f.size("n_head"),
        "use_rotary_position_embeddings": False,
        "add_position_embedding": True,
        "add_bias_linear": True,
        "qk_layernorm": False,
        "untie_embeddings_and_output_weights": not f.get("tie_word_embeddings", bool, True),
        **ACTIVATION_FLAGS[GPT2_ACTIVATIONS[act]],
    }
    defaults = {
        "hidden_dropout": f.get("resid_pdrop", float, 0.1),
        "attention_dropout": f.get("attn_pdrop", float, 0.1),
        "init_method_std": f.get("initializer_range", float, 0.02),
        "seq_length": architecture["max_position_embeddings"],
    }
    return HFModel(GPT2, architecture, defaults, f.size("vocab_size"))


def _biases(f: _Fields, arch: str) -> dict[str, bool]:
    """The bias dests: Llama's attention_bias and mlp_bias (both or neither), Qwen2's q/k/v biases, Mistral none."""
    if arch == QWEN2:  # transformers' Qwen2 builds q/k/v biases whatever config.json says
        return {"add_bias_linear": False, "add_qkv_bias": True}
    if arch == QWEN3:  # its attention_bias is on q, k, v and o_proj, none on the MLP: no flags build that
        f.require("attention_bias", (False,), False, "Qwen3's biases on q, k, v and o alone are not built")
        return {"add_bias_linear": False, "add_qkv_bias": False}
    if arch == MISTRAL:
        return {"add_bias_linear": False, "add_qkv_bias": False}
    attention_bias = f.get("attention_bias", bool, False)
    f.require(
        "mlp_bias",
        (attention_bias,),
        False,
        f"biases are in all linear layers or none (attention_bias is {attention_bias})",
    )
    return {"add_bias_linear": attention_bias, "add_qkv_bias": False}


def _window(f: _Fields, arch: str, layers: int) -> dict[str, str | None]:
    """The dests of `--window-size` and `--window-attn-skip-freq` for the sliding window as transformers reads it:
    Mistral's `sliding_window` W on every layer; Qwen2's only with use_sliding_window, on the layers `layer_types`
    names sliding (when absent: from max_window_layers on); Qwen3's as Qwen2's; Phi-3's as Mistral's, but none when
    absent (Phi3Config's default). W keys, the query's own included, are Megatron-LM's window LEFT = W - 1."""
    none = {"window_size": None, "window_attn_skip_freq": None}
    if arch == LLAMA:
        return none
    kinds = None
    if arch in (QWEN2, QWEN3):
        if not f.get("use_sliding_window", bool, False):
            return none
        kinds = f.hf.get("layer_types") or [
            "sliding_attention" if i >= f.get("max_window_layers", int, 28) else "full_attention" for i in range(layers)
        ]
        if not isinstance(kinds, list) or len(kinds) != layers:
            raise HFConfigError(
                f"{f.source}: layer_types {kinds!r} is not a list of {layers} kinds; fix the config.json"
            )
        unknown = [k for k in kinds if k not in ("full_attention", "sliding_attention")]
        if unknown:
            raise HFConfigError(f"{f.source}: layer_types {unknown[0]!r} is not supported: full or sliding attention")
        if "sliding_attention" not in kinds:
            return none
    # absent is transformers' dataclass default (4096; Phi-3's None), unlike null
    absent = None if arch == PHI3 else TRANSFORMERS_SLIDING_WINDOW
    window = f.get("sliding_window", int, None) if "sliding_window" in f.hf else absent
    if window is not None and window < 1:
        raise HFConfigError(f"{f.source}: sliding_window {window} is not a positive number; fix the config.json")
    if window is None:
        return none
    pattern = None if kinds is None or "full_attention" not in kinds else [int(k == "sliding_attention") for k in kinds]
    return {"window_size": f"{window - 1},0", "window_attn_skip_freq": None if pattern is None else str(pattern)}


def _from_llama(f: _Fields, arch: str = LLAMA) -> HFModel:
    """Llama's layout: Llama, Qwen2 (q/k/v biases), Qwen3 (query and key norms) or Mistral (a sliding window)."""
    act = f.require("hidden_act", tuple(LLAMA_ACTIVATIONS), "silu", f"{arch}'s MLP here is SwiGLU (silu)")
    biases = _biases(f, arch)
    h, heads = f.size("hidden_size"), f.size("num_attention_heads")
    architecture = {
        "num_layers": f.size("num_hidden_layers"),
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_key_value_heads": f.size("num_key_value_heads", heads),
        "kv_channels": _head_dim(f, arch, h, heads),
        "ffn_hidden_size": f.size("intermediate_size"),
        "max_position_embeddings": f.size("max_position_embeddings"),
        "layernorm_epsilon": f.get("rms_norm_eps", float, 1e-6),
        "normalization": LLAMA_NORM.name,
        **ACTIVATION_FLAGS[LLAMA_ACTIVATIONS[act]],
        "use_rotary_position_embeddings": True,
        "rotary_base": _rope_base(f),
        **_scaling_flags(_rope_scaling(f)),
        "rotary_percent": 1.0,  # transformers' Llama rotates whole heads (whatever partial_rotary_factor says)
        "add_position_embedding": False,
        **biases,
        "qk_layernorm": arch == QWEN3,
        "untie_embeddings_and_output_weights": not f.get("tie_word_embeddings", bool, False),
        **_window(f, arch, f.size("num_hidden_layers")),
    }
    defaults = {
        "hidden_dropout": 0.0,  # Llama has no residual dropout
        "attention_dropout": f.get("attention_dropout", float, 0.0),
        "init_method_std": f.get("initializer_range", float, 0.02),
        "seq_length": architecture["max_position_embeddings"],
    }
    return HFModel(arch, architecture, defaults, f.size("vocab_size"))


def _head_dim(f: _Fields, arch: str, hidden: int, heads: int) -> int | None:
    """`--kv-channels` of config.json's `head_dim` (transformers' default when absent or null: hidden_size /
    num_attention_heads, Qwen3's 128); None when it is hidden / heads (no flag, the same model)."""
    default = QWEN3_DEFAULT_HEAD_DIM if arch == QWEN3 else None  # transformers' Qwen3Config default, not h / heads
    head_dim = f.get("head_dim", int, default)
    if head_dim is not None and head_dim < 1:
        raise HFConfigError(f"{f.source}: head_dim {head_dim} is not a positive number; fix the config.json")
    if heads >= 1 and hidden % heads == 0 and head_dim == hidden // heads:
        return None
    return head_dim


def _scaling_flags(factor: float | None) -> dict[str, Any]:
    """The dests of `--use-rope-scaling` / `--rope-scaling-factor` for a scaling factor or None."""
    return {"use_rope_scaling": False} if factor is None else {"use_rope_scaling": True, "rope_scaling_factor": factor}


def _from_phi3(f: _Fields) -> HFModel:
    """Phi-3: Llama's layer without biases, partial rotary embeddings."""
    act = f.require("hidden_act", tuple(LLAMA_ACTIVATIONS), "silu", "Phi-3's MLP here is SwiGLU (silu)")
    h, heads = f.size("hidden_size"), f.size("num_attention_heads")
    f.require(
        "head_dim",
        (None, h // heads),
        None,
        f"Phi-3's head size is hidden_size / num_attention_heads ({h // heads}) here",
    )
    params = f.hf.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", f.hf.get("partial_rotary_factor", 1.0))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise HFConfigError(f"{f.source}: partial_rotary_factor {factor!r} is not in (0, 1]; fix the config.json")
    architecture = {
        "num_layers": f.size("num_hidden_layers"),
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_key_value_heads": f.size("num_key_value_heads", heads),
        "ffn_hidden_size": f.size("intermediate_size"),
        "max_position_embeddings": f.size("max_position_embeddings"),
        "layernorm_epsilon": f.get("rms_norm_eps", float, 1e-5),
        "normalization": PHI3_NORM.name,
        **ACTIVATION_FLAGS[LLAMA_ACTIVATIONS[act]],
        "use_rotary_position_embeddings": True,
        "rotary_base": _plain_rope_base(f),
        "rotary_percent": float(factor),
        "add_position_embedding": False,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": False,
        "untie_embeddings_and_output_weights": not f.get("tie_word_embeddings", bool, False),
        **_window(f, PHI3, f.size("num_hidden_layers")),
    }
    defaults = {
        "hidden_dropout": f.get("resid_pdrop", float, 0.0),
        "attention_dropout": f.get("attention_dropout", float, 0.0),
        "init_method_std": f.get("initializer_range", float, 0.02),
        "seq_length": architecture["max_position_embeddings"],
    }
    return HFModel(PHI3, architecture, defaults, f.size("vocab_size"))


def _plain_rope_base(f: _Fields) -> float:
    """The rotary base of a model with plain rotary embeddings only (Phi-3's scalings are not built)."""
    _rope_scaling(f, allowed=())
    return _rope_base(f)


def _rope_scaling(f: _Fields, allowed: tuple[str, ...] = ("llama3",)) -> float | None:
    """The factor of Llama 3.x's RoPE scaling (rope type `llama3`, its other parameters megatron-core's fixed ones:
    `LLAMA3_ROPE_SCALING`), or None for plain rotary embeddings; another rope type is refused."""
    # transformers < 5 writes rope_theta / rope_scaling; 5 writes rope_parameters {rope_type, rope_theta, ...}, and
    # reads a rope_scaling that is there in place of rope_parameters' type (a config.json may hold both).
    legacy = f.hf.get("rope_scaling")
    params = f.hf.get("rope_parameters") or {}
    scaling, name = (legacy, "rope_scaling") if isinstance(legacy, dict) and legacy else (params, "rope_parameters")
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    if kind not in allowed:
        built = "plain and Llama 3.x-scaled (llama3)" if allowed else "only plain"
        raise HFConfigError(f"{f.source}: {name} type {kind!r} is not supported: {built} rotary embeddings are built")
    for key, value in LLAMA3_ROPE_SCALING.items():
        if scaling.get(key, value) != value:
            raise HFConfigError(
                f"{f.source}: {name} {key} {scaling.get(key)!r} is not supported: Llama 3.x's scaling is built with "
                f"{key} {value:g}, as megatron-core fixes it (every Llama 3.x config.json has it)"
            )
    factor = scaling.get("factor")
    if not _positive_number(factor):
        raise HFConfigError(f"{f.source}: {name} factor {factor!r} is not a positive number; fix the config.json")
    return float(factor)


def _rope_base(f: _Fields) -> float:
    params = f.hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", f.hf.get("rope_theta", DEFAULT_ROTARY_BASE))
    if not _positive_number(theta):
        raise HFConfigError(f"{f.source}: rope_theta {theta!r} is not a positive number; fix the config.json")
    return float(theta)


def _positive_number(value: Any) -> bool:
    """A finite number > 0 as JSON gives it (a bool is not one)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def render_flags(values: dict[str, Any]) -> list[str]:
    """pretrain_gpt.py flags that set these argparse dests (inverse of parsing)."""
    from megatron_ds.flags.parser import build_parser

    actions = {a.dest: a for a in build_parser()._actions if a.option_strings}
    argv: list[str] = []
    for dest, value in values.items():
        action = actions[dest]
        flag = action.option_strings[0]
        if action.nargs == 0:  # a switch: giving it flips the default
            if value != action.default:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv
