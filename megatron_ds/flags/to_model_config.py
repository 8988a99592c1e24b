"""Parsed flags -> the model section (`ModelConfig`): the sizes a line must give, upstream's defaults
that depend on other flags (ffn width 4h or SwiGLU's, positions = sequence length), the vocabulary
(--vocab-size, else the tokenizer's, padded as Megatron pads it), the MLP activation Megatron's flags
select (`model_activation`, and its inverse `ACTIVATION_FLAGS`), and the warnings for model flags that
are ignored. Where Megatron-LM and Megatron-DeepSpeed spell one option two ways (norms, position
embeddings, GQA), `megatron_ds.flags.model_flags` reads both. `megatron_ds.flags.to_config` builds the
whole tree with this section (and `model_config_of`, the planner's, this section alone).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from megatron_ds.config import ModelConfig, default_ffn_hidden_size, padded_vocab_size
from megatron_ds.errors import ConfigError
from megatron_ds.flags import megatron_lm_moe, model_flags, window_flags
from megatron_ds.flags.declare import flag_of
from megatron_ds.flags.notices import warn


def _require(args: argparse.Namespace, *names: str) -> None:
    missing = [n for n in names if getattr(args, n) is None]
    if missing:
        raise ConfigError(f"missing required flag(s) {', '.join(map(flag_of, missing))}; give a value for each")


def tokenizer_type(args: argparse.Namespace) -> str | None:
    """--tokenizer-type; GPT2BPETokenizer when only --vocab-file/--merge-file are given, as Megatron's
    pretrain_gpt.py defaults it (its `args_defaults`)."""
    if args.tokenizer_type is None and (args.vocab_file or args.merge_file):
        return "GPT2BPETokenizer"
    return args.tokenizer_type


def _vocab_size(args: argparse.Namespace) -> int:
    """Padded vocabulary from --vocab-size and/or the tokenizer (0 only for --print-layout)."""
    base = unpadded_vocab_size(args)
    return padded_vocab_size(base, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size) if base else 0


def unpadded_vocab_size(args: argparse.Namespace) -> int:
    """The tokens: --vocab-size, else the tokenizer's size (0 only for --print-layout without either)."""
    kind = tokenizer_type(args)
    tokenizer_vocab = (
        _tokenizer_vocab(kind, args.tokenizer_model, args.vocab_file, args.merge_file, args.vocab_size)
        if kind is not None
        else None
    )
    if args.vocab_size is not None:
        if args.vocab_size < 1:
            raise ConfigError(f"--vocab-size {args.vocab_size} must be >= 1")
        if tokenizer_vocab is not None and tokenizer_vocab > args.vocab_size:
            source = args.tokenizer_model or args.vocab_file
            raise ConfigError(
                f"tokenizer {source} has {tokenizer_vocab} tokens but --vocab-size is "
                f"{args.vocab_size}; raise --vocab-size or drop it to use the tokenizer's size"
            )
        return args.vocab_size
    if tokenizer_vocab is not None:
        return tokenizer_vocab
    if args.print_layout:
        return 0
    raise ConfigError(
        "no vocabulary size: give --vocab-size, or --tokenizer-type with --tokenizer-model "
        "(or --vocab-file/--merge-file)"
    )


@functools.lru_cache(maxsize=8)  # the model and data sections both ask
def _tokenizer_vocab(
    kind: str, model: str | None, vocab_file: str | None, merge_file: str | None, size: int | None
) -> int:
    from megatron_ds.data.tokenizer import build_tokenizer

    tok = build_tokenizer(kind, tokenizer_model=model, vocab_file=vocab_file, merge_file=merge_file, vocab_size=size)
    return tok.vocab_size


def _ffn_hidden_size(args: argparse.Namespace, activation: str) -> int:
    """--ffn-hidden-size (with Megatron-LM's experts on every layer their --moe-ffn-hidden-size), else upstream's
    default for the activation; a SwiGLU default of 0 (a hidden size under 24) names --swiglu, which chose it, rather
    than --ffn-hidden-size, which was not given."""
    experts = megatron_lm_moe.experts_ffn_size(args)
    if experts is not None:
        return experts
    if args.ffn_hidden_size is not None:
        return args.ffn_hidden_size
    width = default_ffn_hidden_size(args.hidden_size, activation)
    if width < 1 and args.hidden_size >= 1 and activation == "swiglu":
        raise ConfigError(
            f"--swiglu's default ffn width for --hidden-size {args.hidden_size} is {width} "
            f"(int(8 x {args.hidden_size} / 3 / 64) x 64, as upstream); give --ffn-hidden-size"
        )
    return width


def _max_positions(args: argparse.Namespace) -> int:
    """--max-position-embeddings, else --seq-length (a given 0 is refused by ModelConfig, not replaced)."""
    return args.seq_length if args.max_position_embeddings is None else args.max_position_embeddings


def build_model_config(args: argparse.Namespace, direct: dict[str, Any]) -> ModelConfig:
    """The model section from the parsed flags and the values copied as given (`direct`)."""
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length")
    rotary, table = model_flags.position_embeddings(args)
    norm, norm_warning = model_flags.normalization(args)
    activation = model_activation(args)
    model = ModelConfig(
        **direct,
        **megatron_lm_moe.model_fields(args),
        ffn_hidden_size=_ffn_hidden_size(args, activation),
        max_position_embeddings=_max_positions(args),
        vocab_size=_vocab_size(args),
        use_rotary_position_embeddings=rotary,
        add_position_embedding=table,
        activation=activation,
        normalization=norm,
        num_key_value_heads=model_flags.key_value_heads(args),
        window_size=window_flags.window_size(args),
        window_attn_skip_freq=window_flags.window_layers(args),
    )
    _check_fixed_model_options(args, model)
    megatron_lm_moe.check_model(args, model)
    model_flags.check_parallel_modes(args)
    if norm_warning:
        warn(norm_warning)
    if args.rotary_base != model.rotary_base:
        warn(f"--rotary-base {args.rotary_base:g} only applies with --use-rotary-position-embeddings; ignored")
    if args.rotary_percent != model.rotary_percent:
        warn(f"--rotary-percent {args.rotary_percent:g} only applies with --use-rotary-position-embeddings; ignored")
    if args.qk_layernorm and model.qk_l2_norm:
        warn("--qk-layernorm with --qk-l2-norm: megatron-core builds the weightless L2 norm alone, as here; ignored")
    if args.use_rope_scaling and not model.use_rope_scaling:
        warn("--use-rope-scaling only applies with --use-rotary-position-embeddings; ignored")
    if args.rope_scaling_factor != model.rope_scaling_factor:
        warn(f"--rope-scaling-factor {args.rope_scaling_factor:g} only applies with --use-rope-scaling; ignored")
    return model


def _check_fixed_model_options(args: argparse.Namespace, model: ModelConfig) -> None:
    """Megatron options accepted only at the one value the model builds."""
    if args.vocab_extra_ids != 0:
        raise ConfigError(
            f"--vocab-extra-ids {args.vocab_extra_ids} is not supported: extra sentinel ids are "
            f"for T5-style models; drop it"
        )


ACTIVATION_FLAGS: dict[str, dict[str, bool]] = {
    "gelu_tanh": {"openai_gelu": True, "swiglu": False, "squared_relu": False},
    "gelu": {"openai_gelu": False, "bias_gelu_fusion": False, "swiglu": False, "squared_relu": False},
    "swiglu": {"swiglu": True, "openai_gelu": False, "squared_relu": False},
    "squared_relu": {"squared_relu": True, "swiglu": False, "openai_gelu": False},
}
"""Flag values (argparse dests) that select each activation whatever the other flags say; the
Hugging Face import renders these (`interop/hf_config_read.py`). `model_activation` is the inverse."""


def model_activation(args: Any) -> str:
    """The MLP activation Megatron-DeepSpeed's ParallelMLP builds for these flags (parsed values, by
    argparse dest: swiglu, squared_relu, openai_gelu, bias_gelu_fusion, add_bias_linear): --swiglu; else
    --squared-relu (relu(x)^2, as its ParallelMLP); else
    --openai-gelu's tanh GeLU; else its fused bias-GeLU (on by default, off with --no-bias-gelu-fusion
    or --disable-bias-linear), whose kernel is the tanh approximation; else torch's exact GeLU."""
    if args.swiglu and args.openai_gelu:
        raise ConfigError(
            "--openai-gelu and --swiglu were both given; Megatron-DeepSpeed would apply GeLU to SwiGLU's doubled "
            "fc1 output and fail: keep one"
        )
    if args.squared_relu and (args.swiglu or args.openai_gelu):
        other = "--swiglu" if args.swiglu else "--openai-gelu"
        raise ConfigError(
            f"--squared-relu and {other} were both given; Megatron-DeepSpeed silently uses {other} and Megatron-LM "
            "refuses the pair: keep one"
        )
    if args.swiglu:
        return "swiglu"
    if args.squared_relu:
        return "squared_relu"
    fused = args.bias_gelu_fusion and args.add_bias_linear
    return "gelu_tanh" if args.openai_gelu or fused else "gelu"
