"""A Hugging Face `config.json` read into pretrain_gpt.py's flags (`from_hf_config`, `render_flags`), one reader per
architecture of `hf_architectures.ARCHITECTURE_CLASSES` (the mixture-of-experts ones in `hf_config_experts.py`); the
other direction is `hf_config.py`, what each architecture requires of our model `hf_architectures.py`. A field we do
not build is a `HFConfigError` naming it. Nothing here imports transformers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_ds.config.model import DEFAULT_ROTARY_BASE, LLAMA3_ROPE_SCALING
from megatron_ds.flags.to_model_config import ACTIVATION_FLAGS
from megatron_ds.interop import hf_config_experts
from megatron_ds.interop.hf_architectures import (
    ARCHITECTURE_CLASSES,
    GPT2,
    GPT2_NORM,
    LLAMA,
    LLAMA_LAYOUT,
    LLAMA_NORM,
    MISTRAL,
    MIXTRAL,
    PHI3,
    PHI3_NORM,
    QWEN2,
    QWEN2_MOE,
    QWEN3,
    QWEN3_MOE,
    HFConfigError,
)
from megatron_ds.model import activations

GPT2_ACTIVATIONS: dict[str, str] = {
    hf: a.name for a in activations.REGISTRY.values() if not a.gated for hf in a.hf_names
}
"""GPT-2's `activation_function` -> our activation: `gelu_new` (GPT-2's default), `gelu_pytorch_tanh`
and `gelu_fast` are the tanh form, `gelu` the exact one."""
LLAMA_ACTIVATIONS: dict[str, str] = {hf: a.name for a in activations.REGISTRY.values() if a.gated for hf in a.hf_names}
"""Llama's `hidden_act` (the gate's function) -> our gated activation."""
TRANSFORMERS_SLIDING_WINDOW = 4096
"""MistralConfig's, Qwen2Config's and Qwen3Config's `sliding_window` when config.json has no such key."""
QWEN3_DEFAULT_HEAD_DIM = 128
"""transformers' Qwen3Config `head_dim` when config.json has none (whatever hidden_size / num_attention_heads is)."""
ABSENT_KV_HEADS = {MISTRAL: 8, MIXTRAL: 8, QWEN2: 32, QWEN3: 32, QWEN3_MOE: 4, QWEN2_MOE: 16}
"""transformers' `num_key_value_heads` when config.json has none (Llama's and Phi-3's: num_attention_heads)."""
ABSENT_RMS_EPS = {MIXTRAL: 1e-5}
"""transformers' `rms_norm_eps` when config.json has none, where it is not Llama's 1e-6 (Phi-3's is read apart)."""
ABSENT_ROPE_THETA = {MIXTRAL: 1e6}
"""transformers' rope base when config.json has neither `rope_theta` nor `rope_parameters` (MixtralConfig's
`default_theta`), where it is not 10000."""


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
    if model_type in hf_config_experts.READERS:
        return hf_config_experts.READERS[model_type](reader, _from_llama)
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
    if arch == QWEN2_MOE:  # q/k/v biases by qkv_bias (always, before transformers 5)
        f.require("qkv_bias", (True,), True, "Qwen2-MoE without q/k/v biases is not built")
        return {"add_bias_linear": False, "add_qkv_bias": True}
    if arch in (QWEN3, QWEN3_MOE):  # its attention_bias is on q, k, v and o_proj, none on the MLP: no flags build that
        f.require("attention_bias", (False,), False, "Qwen3's biases on q, k, v and o alone are not built")
        return {"add_bias_linear": False, "add_qkv_bias": False}
    if arch in (MISTRAL, MIXTRAL):
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
    # absent is transformers' dataclass default (4096; Phi-3's and Mixtral's None), unlike null
    absent = None if arch in (PHI3, MIXTRAL) else TRANSFORMERS_SLIDING_WINDOW
    window = f.get("sliding_window", int, None) if "sliding_window" in f.hf else absent
    if window is not None and window < 1:
        raise HFConfigError(f"{f.source}: sliding_window {window} is not a positive number; fix the config.json")
    if window is None:
        return none
    pattern = None if kinds is None or "full_attention" not in kinds else [int(k == "sliding_attention") for k in kinds]
    return {"window_size": f"{window - 1},0", "window_attn_skip_freq": None if pattern is None else str(pattern)}


def _from_llama(f: _Fields, arch: str = LLAMA) -> HFModel:
    """Llama's layout: Llama, Qwen2 (q/k/v biases), Qwen3 (query and key norms), Mistral (a sliding window) or, its
    MLP aside, Mixtral."""
    act = f.require("hidden_act", tuple(LLAMA_ACTIVATIONS), "silu", f"{arch}'s MLP here is SwiGLU (silu)")
    biases = _biases(f, arch)
    h, heads = f.size("hidden_size"), f.size("num_attention_heads")
    architecture = {
        "num_layers": f.size("num_hidden_layers"),
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_key_value_heads": f.size("num_key_value_heads", ABSENT_KV_HEADS.get(arch, heads)),
        "kv_channels": _head_dim(f, arch, h, heads),
        "ffn_hidden_size": f.size("intermediate_size"),
        "max_position_embeddings": f.size("max_position_embeddings"),
        "layernorm_epsilon": f.get("rms_norm_eps", float, ABSENT_RMS_EPS.get(arch, 1e-6)),
        "normalization": LLAMA_NORM.name,
        **ACTIVATION_FLAGS[LLAMA_ACTIVATIONS[act]],
        "use_rotary_position_embeddings": True,
        "rotary_base": _rope_base(f, ABSENT_ROPE_THETA.get(arch, DEFAULT_ROTARY_BASE)),
        **_scaling_flags(_rope_scaling(f)),
        "rotary_percent": 1.0,  # transformers' Llama rotates whole heads (whatever partial_rotary_factor says)
        "add_position_embedding": False,
        **biases,
        "qk_layernorm": arch in (QWEN3, QWEN3_MOE),
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


def _rope_base(f: _Fields, absent: float = DEFAULT_ROTARY_BASE) -> float:
    """`rope_theta` (transformers 5: in `rope_parameters`), `absent` when config.json has neither."""
    params = f.hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", f.hf.get("rope_theta", absent))
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
        elif isinstance(value, (list, tuple)):  # nargs="+": one value per item
            argv += [flag, *map(str, value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv
