"""The pure parts of Hugging Face interop: the sharding table, the config tables, and their errors."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.flags.to_model_config import ACTIVATION_FLAGS, model_activation
from megatron_ds.interop import hf_architectures, hf_config, hf_config_read, hf_weights
from megatron_ds.interop.hf_architectures import HFConfigError
from megatron_ds.model import naming, norms, sharding
from megatron_ds.model.init import shard_qkv
from megatron_ds.model.layers import FinalNorm, LMHead, PositionEmbedding, WordEmbedding
from megatron_ds.model.transformer import TransformerLayer

GPT = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    seq_length=16,
    max_position_embeddings=32,
    vocab_size=256,
)
REG = RegularizationConfig()
LLAMA = dataclasses.replace(
    GPT,
    normalization="rmsnorm",
    activation="swiglu",
    use_rotary_position_embeddings=True,
    add_position_embedding=False,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    num_key_value_heads=2,
    ffn_hidden_size=48,
)
QWEN2 = dataclasses.replace(LLAMA, add_qkv_bias=True, rotary_base=1e6)  # Qwen2.5's base
QWEN3 = dataclasses.replace(LLAMA, qk_layernorm=True, rotary_base=1e6)
PHI3_WIDE = dataclasses.replace(LLAMA, rotary_percent=0.5, kv_channels=16)  # partial rotary exports as Phi-3
MODULES = {
    naming.WORD_EMBEDDING: WordEmbedding,
    naming.POSITION_EMBEDDING: PositionEmbedding,
    naming.TRANSFORMER_LAYER: TransformerLayer,
    naming.FINAL_NORM: FinalNorm,
    naming.UNTIED_LM_HEAD: LMHead,
}


@pytest.mark.parametrize(
    "model",
    [
        GPT,
        LLAMA,
        dataclasses.replace(LLAMA, add_bias_linear=True),
        QWEN2,
        QWEN3,
        dataclasses.replace(QWEN3, kv_channels=12),
    ]
    + [dataclasses.replace(GPT, normalization=norm, qk_layernorm=True) for norm in norms.REGISTRY],
    ids=[
        "gpt",
        "llama",
        "llama_bias",
        "qwen2",
        "qwen3",
        "qwen3_kv_channels",
        *(f"gpt_{norm}_qk_layernorm" for norm in norms.REGISTRY),
    ],
)
def test_tensor_table_matches_the_layers(model: ModelConfig) -> None:
    for spec in naming.gpt_spec_groups(model).names:
        rules = sharding.spec_tensors(model, spec)
        if spec not in MODULES:
            assert rules == {}
            continue
        with torch.device("meta"):
            cls = MODULES[spec]
            module = cls(model, 0) if cls is FinalNorm else cls(model, REG, 0)  # norms take no init settings
        assert {k: tuple(p.shape) for k, p in module.named_parameters()} == {k: r.shape for k, r in rules.items()}


@pytest.mark.parametrize("model", [GPT, LLAMA, QWEN3], ids=["gpt", "llama_gqa", "qwen3"])
def test_split_then_gather_is_identity_and_matches_the_model_sharding(model: ModelConfig) -> None:
    gen = torch.Generator().manual_seed(0)
    for spec in set(naming.gpt_spec_groups(model).names):
        for key, rule in sharding.spec_tensors(model, spec).items():
            full = torch.randn(rule.shape, generator=gen)
            shards = sharding.split(rule, full, 2)
            assert torch.equal(sharding.gather(rule, shards), full), (spec, key)
            if key == "qkv.weight":  # the model's own cut of a fused QKV (GQA: kv heads per rank)
                for r in range(2):
                    assert torch.equal(shards[r], shard_qkv(full, model.num_attention_heads, 2, r, model.kv_heads))
            assert all(s.untyped_storage().nbytes() == s.numel() * s.element_size() for s in shards)


def test_replicas_that_differ_are_detected() -> None:
    assert sharding.replicas_differ([torch.ones(2), torch.zeros(2)])
    assert not sharding.replicas_differ([torch.ones(2), torch.ones(2)])


def _activation(architecture: dict) -> str:
    """The activation pretrain_gpt.py builds from these argparse values (the others at their defaults)."""
    from megatron_ds.flags.parser import build_parser

    defaults = vars(build_parser().parse_known_args([])[0])
    return model_activation(argparse.Namespace(**{**defaults, **architecture}))


@pytest.mark.parametrize(
    "model",
    [
        GPT,
        dataclasses.replace(GPT, activation="gelu"),
        LLAMA,
        dataclasses.replace(LLAMA, untie_embeddings_and_output_weights=False, rotary_base=500000.0),
        QWEN2,
        QWEN3,
        dataclasses.replace(QWEN3, untie_embeddings_and_output_weights=False),
    ],
    ids=["gpt", "gpt_exact_gelu", "llama", "tied_llama3_base", "qwen2", "qwen3", "tied_qwen3"],
)
def test_config_round_trip(model: ModelConfig) -> None:
    hf = hf_config.to_hf_config(model, REG, 200, "float32", {"eos_token_id": 2})
    back = hf_config_read.from_hf_config(hf, "config.json")
    activation_dests = {d for flags in ACTIVATION_FLAGS.values() for d in flags}
    for dest, value in back.architecture.items():
        if dest == "num_key_value_heads":
            assert value == model.kv_heads
        elif dest not in (*activation_dests, "use_rotary_position_embeddings", "add_position_embedding"):
            assert getattr(model, dest) == value, dest
    assert _activation(back.architecture) == model.activation
    assert back.vocab_size == 200 and back.arch == hf_architectures.architecture_of(model)


@pytest.mark.parametrize(
    "hf_name,ours",
    [("gelu_new", "gelu_tanh"), ("gelu_pytorch_tanh", "gelu_tanh"), ("gelu", "gelu"), ("relu2", "squared_relu")],
)
def test_gpt2_activation_names(hf_name: str, ours: str) -> None:
    """GPT-2's own `gelu_new` and torch's tanh GeLU are our default; `gelu` is the exact one."""
    hf = {**hf_config.to_hf_config(GPT, REG, 200, "float32", {}), "activation_function": hf_name}
    architecture = hf_config_read.from_hf_config(hf, "x").architecture
    assert _activation(architecture) == ours
    exported = hf_config.to_hf_config(dataclasses.replace(GPT, activation=ours), REG, 200, "float32", {})
    assert exported["activation_function"] == {"gelu_tanh": "gelu_new", "gelu": "gelu", "squared_relu": "relu2"}[ours]


def test_transformers_own_configs_are_read() -> None:
    transformers = pytest.importorskip("transformers")
    gpt = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, activation_function="gelu").to_dict()
    assert hf_config_read.from_hf_config(gpt, "x").architecture["ffn_hidden_size"] == 128
    llama = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2).to_dict()
    assert hf_config_read.from_hf_config(llama, "x").architecture["num_key_value_heads"] == 2


@pytest.mark.parametrize(
    "change, flag",
    [
        ({"add_bias_linear": False}, "--disable-bias-linear"),
        ({"normalization": "rmsnorm"}, "--normalization rmsnorm"),
        ({"num_key_value_heads": 2}, "--num-key-value-heads"),
        ({"use_rotary_position_embeddings": True, "add_position_embedding": False}, "--use-rotary-position-embeddings"),
    ],
)
def test_gelu_models_hf_cannot_express_are_errors(change: dict, flag: str) -> None:
    with pytest.raises(HFConfigError, match="cannot export to Hugging Face gpt2: " + flag) as err:
        hf_architectures.architecture_of(dataclasses.replace(GPT, **change))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("norm", norms.REGISTRY)
def test_each_architecture_takes_its_own_norm_only(norm: str) -> None:
    for arch, model in ((hf_architectures.GPT2, GPT), (hf_architectures.LLAMA, LLAMA)):
        changed = dataclasses.replace(model, normalization=norm)
        if arch in norms.find(norm).hf_model_types:
            assert hf_architectures.architecture_of(changed) == arch
            hf = hf_config.to_hf_config(changed, REG, 200, "float32", {})
            assert hf_config_read.from_hf_config(hf, "x").architecture["normalization"] == norm
        else:
            with pytest.raises(HFConfigError, match=f"Hugging Face {arch}: --normalization {norm}: "):
                hf_architectures.architecture_of(changed)


def test_partial_rotary_exports_as_phi3_and_round_trips() -> None:
    partial = dataclasses.replace(LLAMA, rotary_percent=0.5)
    assert hf_architectures.architecture_of(LLAMA) == hf_architectures.LLAMA
    assert hf_architectures.architecture_of(partial) == hf_architectures.PHI3
    hf = hf_config.to_hf_config(partial, REG, 200, "float32", {})
    assert (hf["model_type"], hf["partial_rotary_factor"], hf["pad_token_id"]) == ("phi3", 0.5, None)
    back = hf_config_read.from_hf_config(hf, "x")
    assert back.arch == hf_architectures.PHI3 and back.architecture["rotary_percent"] == 0.5
    with pytest.raises(HFConfigError, match="phi3: biases with --rotary-percent 0.5: .*Phi-3, which has no biases"):
        hf_architectures.architecture_of(dataclasses.replace(partial, add_bias_linear=True))
    assert hf["sliding_window"] is None and _window(back) == (None, None)
    assert _window(hf_config_read.from_hf_config({**hf, "sliding_window": 128}, "x")) == ("127,0", None)  # every layer
    absent = {k: v for k, v in hf.items() if k != "sliding_window"}  # Phi3Config's default: no window
    assert _window(hf_config_read.from_hf_config(absent, "x")) == (None, None)
    windowed = hf_config.to_hf_config(dataclasses.replace(partial, window_size=(127, 0)), REG, 200, "float32", {})
    assert (windowed["model_type"], windowed["sliding_window"]) == ("phi3", 128)
    with pytest.raises(HFConfigError, match="phi3: --use-rope-scaling with --rotary-percent below 1"):
        hf_architectures.architecture_of(dataclasses.replace(partial, use_rope_scaling=True))
    llama3 = {"rope_type": "llama3", "factor": 8.0}
    with pytest.raises(HFConfigError, match="rope_scaling type 'llama3' is not supported: only plain rotary"):
        hf_config_read.from_hf_config({**hf, "rope_scaling": llama3}, "x")


def test_llama3_rope_scaling_round_trips_in_both_transformers_spellings() -> None:
    """transformers < 5 writes `rope_scaling` beside `rope_theta`, 5 one `rope_parameters`; export writes the former,
    which both read."""
    scaled = dataclasses.replace(LLAMA, use_rope_scaling=True, rope_scaling_factor=32.0)
    hf = hf_config.to_hf_config(scaled, REG, 200, "float32", {})
    assert hf["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert hf_config.to_hf_config(LLAMA, REG, 200, "float32", {})["rope_scaling"] is None
    new_style = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta")}
    new_style["rope_parameters"] = {**hf["rope_scaling"], "rope_theta": hf["rope_theta"]}
    for config in (hf, new_style):
        architecture = hf_config_read.from_hf_config(config, "x").architecture
        assert (architecture["use_rope_scaling"], architecture["rope_scaling_factor"]) == (True, 32.0)
        assert architecture["rotary_base"] == LLAMA.rotary_base
    assert hf_config_read.from_hf_config(_llama_json(), "x").architecture["use_rope_scaling"] is False


def test_swiglu_with_layernorm_is_an_error() -> None:
    with pytest.raises(HFConfigError, match="llama: --normalization layernorm"):
        hf_architectures.architecture_of(dataclasses.replace(LLAMA, normalization="layernorm"))


def _llama_json(**change: object) -> dict:
    base = hf_config.to_hf_config(LLAMA, REG, 200, "float32", {})
    return {**base, **change}


def _qwen2_json(**change: object) -> dict:
    return {**hf_config.to_hf_config(QWEN2, REG, 200, "float32", {}), **change}


def _qwen3_json(**change: object) -> dict:
    return {**hf_config.to_hf_config(QWEN3, REG, 200, "float32", {}), **change}


def _mistral_json(**change: object) -> dict:
    return {**hf_config.to_hf_config(LLAMA, REG, 200, "float32", {}, hf_architectures.MISTRAL), **change}


def test_a_qkv_bias_alone_exports_as_qwen2_and_a_bias_free_llama_as_mistral_on_request() -> None:
    assert hf_architectures.architecture_of(QWEN2) == hf_architectures.QWEN2
    hf = _qwen2_json()
    assert (hf["model_type"], hf["architectures"], hf["use_sliding_window"]) == ("qwen2", ["Qwen2ForCausalLM"], False)
    assert "attention_bias" not in hf and hf["rope_theta"] == 1e6
    back = hf_config_read.from_hf_config(hf, "x")
    assert back.arch == hf_architectures.QWEN2 and _window(back) == (None, None)
    assert (back.architecture["add_qkv_bias"], back.architecture["add_bias_linear"]) == (True, False)
    mistral = hf_config_read.from_hf_config(_mistral_json(), "x")
    assert (mistral.arch, mistral.architecture["add_bias_linear"], _window(mistral)) == ("mistral", False, (None, None))
    assert _window(hf_config_read.from_hf_config(_mistral_json(sliding_window=4096), "x")) == ("4095,0", None)
    absent = {k: v for k, v in _mistral_json().items() if k != "sliding_window"}  # MistralConfig's default
    assert _window(hf_config_read.from_hf_config(absent, "x")) == ("4095,0", None)


def _window(hf: hf_config_read.HFModel) -> tuple[str | None, str | None]:
    """The --window-size and --window-attn-skip-freq values an import renders."""
    return hf.architecture["window_size"], hf.architecture["window_attn_skip_freq"]


@pytest.mark.parametrize(
    "model, model_type, problem",
    [
        (QWEN2, "mistral", "mistral: --add-qkv-bias: Mistral has no biases"),
        (QWEN2, "llama", "llama: --add-qkv-bias: of these types only Qwen2"),
        (LLAMA, "qwen2", "qwen2: no --add-qkv-bias: Qwen2 has q/k/v biases .a model without biases"),
        (dataclasses.replace(LLAMA, add_bias_linear=True), "mistral", "mistral: biases .no --disable-bias-linear."),
        (dataclasses.replace(LLAMA, add_bias_linear=True), "qwen2", "qwen2: no --add-qkv-bias: .* and no others"),
        (dataclasses.replace(QWEN2, rotary_percent=0.5), None, "phi3: --add-qkv-bias"),
        (GPT, "mistral", "--hf-model-type mistral: the checkpoint's model exports as gpt2 only"),
        (LLAMA, "gemma", "--hf-model-type gemma: choose one of gpt2, llama, qwen2, qwen3, mistral, phi3"),
        (QWEN3, "llama", "llama: --qk-layernorm: of these types only Qwen3"),
        (LLAMA, "qwen3", "qwen3: no --qk-layernorm: Qwen3 has query and key norms"),
        (dataclasses.replace(QWEN3, add_bias_linear=True), None, "qwen3: biases .no --disable-bias-linear.: Qwen3's"),
        (dataclasses.replace(QWEN3, add_qkv_bias=True), None, "qwen3: --add-qkv-bias: of these types only Qwen2"),
        (dataclasses.replace(QWEN3, rotary_percent=0.5), None, "qwen3: --rotary-percent 0.5: Qwen3 rotates whole"),
        (dataclasses.replace(GPT, qk_layernorm=True), None, "gpt2: --qk-layernorm: of these types only Qwen3"),
        (dataclasses.replace(GPT, window_size=(3, 0)), None, "gpt2: --window-size: this type has no sliding window"),
        (dataclasses.replace(LLAMA, window_size=(3, 0)), "llama", "llama: --window-size: this type has no sliding"),
        (
            dataclasses.replace(LLAMA, window_size=(3, 0), window_attn_skip_freq=(1, 0)),
            None,
            "mistral: --window-attn-skip-freq: Mistral's sliding window is on every layer",
        ),
        (
            dataclasses.replace(LLAMA, window_size=(3, 0), window_attn_skip_freq=(1, 0), rotary_percent=0.5),
            None,
            "phi3: --window-attn-skip-freq with --rotary-percent below 1: .*Phi-3, whose sliding window is on every",
        ),
        (
            dataclasses.replace(LLAMA, window_size=(3, 0), add_bias_linear=True),
            None,
            "mistral: biases .no --disable-bias-linear.: Mistral has none",
        ),
    ],
)
def test_a_model_type_that_is_not_exact_is_refused(model: ModelConfig, model_type: str | None, problem: str) -> None:
    with pytest.raises(HFConfigError, match=problem) as err:
        hf_architectures.architecture_of(model, model_type)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "change, window",
    [
        ({}, (None, None)),
        ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, ("15,0", "[0, 1]")),
        ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, ("15,0", None)),  # every layer
        ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}, (None, None)),  # none from 2 of 2
        ({"use_sliding_window": True, "sliding_window": 16, "layer_types": ["full_attention"] * 2}, (None, None)),
        (
            {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
            ("15,0", "[1, 0]"),
        ),  # layer_types wins over max_window_layers
        ({"use_sliding_window": False, "sliding_window": 16, "layer_types": ["sliding_attention"] * 2}, (None, None)),
    ],
)
def test_qwen2s_window_is_the_one_transformers_applies(change: dict, window: tuple) -> None:
    """As Qwen2Config derives it: sliding_window W keys (Megatron-LM's LEFT W - 1) on the layers layer_types names
    sliding, from max_window_layers on when it names none; nothing without use_sliding_window."""
    assert _window(hf_config_read.from_hf_config(_qwen2_json(**change), "x")) == window


@pytest.mark.parametrize(
    "hf, field",
    [
        (
            {**hf_config.to_hf_config(GPT, REG, 200, "float32", {}), "activation_function": "quick_gelu"},
            "activation_function 'quick_gelu' is not supported",
        ),
        (
            {**hf_config.to_hf_config(GPT, REG, 200, "float32", {}), "scale_attn_by_inverse_layer_idx": True},
            "scale_attn",
        ),
        (_llama_json(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling type 'linear'"),
        (_llama_json(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}), "rope_parameters factor None"),
        (  # both keys: transformers takes rope_scaling's type over rope_parameters' (it imported as plain rotary)
            _llama_json(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rope_scaling={"type": "linear"}),
            "rope_scaling type 'linear' is not supported",
        ),
        (
            _llama_json(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}),
            "low_freq_factor 2.0",
        ),
        (
            _llama_json(rope_scaling={"rope_type": "llama3", "factor": 8, "original_max_position_embeddings": 4096}),
            "original_max_position_embeddings 4096 is not supported: Llama 3.x's scaling is built with "
            "original_max_position_embeddings 8192",
        ),
        (_llama_json(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "type 'yarn' is not supported: plain and"),
        (_llama_json(rope_theta=-1.0), "rope_theta -1.0 is not a positive number"),
        (_llama_json(rope_parameters={"rope_type": "default", "rope_theta": "big"}), "rope_theta 'big'"),
        (_llama_json(attention_bias=True, mlp_bias=False), "mlp_bias"),
        (_llama_json(hidden_act="gelu"), "hidden_act"),
        (_llama_json(model_type="gemma"), "model_type 'gemma'"),
        (_llama_json(head_dim=0), "head_dim 0 is not a positive number"),
        (_llama_json(head_dim="8"), "head_dim '8' is not an int"),
        (_qwen2_json(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn' is not supported"),
        (_qwen2_json(use_sliding_window=True, layer_types=["full_attention", "chunked_attention"]), "'chunked_"),
        (_qwen2_json(hidden_act="gelu"), "hidden_act"),
        (_qwen3_json(attention_bias=True), "attention_bias True is not supported: Qwen3's biases on q, k, v and o"),
        (_mistral_json(sliding_window=0), "sliding_window 0 is not a positive number"),
        ({k: v for k, v in _llama_json().items() if k != "hidden_size"}, "no 'hidden_size' field"),
        (_llama_json(num_hidden_layers="2"), "num_hidden_layers '2' is not an int"),
    ],
)
def test_unsupported_hf_fields_are_one_line_errors(hf: dict, field: str) -> None:
    with pytest.raises(HFConfigError, match=field) as err:
        hf_config_read.from_hf_config(hf, "m/config.json")
    assert str(err.value).startswith("m/config.json: ") and "\n" not in str(err.value)


def test_qwen3_is_llama_with_query_and_key_norms_and_its_head_dim() -> None:
    hf = _qwen3_json()
    assert (hf["model_type"], hf["architectures"], hf["head_dim"], hf["attention_bias"]) == (
        "qwen3",
        ["Qwen3ForCausalLM"],
        8,
        False,
    )
    back = hf_config_read.from_hf_config(hf, "x")
    assert back.arch == hf_architectures.QWEN3 and back.architecture["qk_layernorm"] and _window(back) == (None, None)
    assert not hf_config_read.from_hf_config(_llama_json(), "x").architecture["qk_layernorm"]
    shapes = hf_weights.hf_shapes(hf_architectures.QWEN3, QWEN3, 200)
    assert shapes["model.layers.1.self_attn.q_norm.weight"] == shapes["model.layers.1.self_attn.k_norm.weight"] == (8,)
    assert len(shapes) == len(hf_weights.hf_shapes(hf_architectures.LLAMA, LLAMA, 200)) + 2 * LLAMA.num_layers


def test_head_dim_is_kv_channels_both_ways() -> None:
    """config.json's head_dim is --kv-channels, absent (no flag) at hidden / heads; Qwen3's default is 128."""
    for hf in (
        _llama_json(head_dim=16),
        _mistral_json(head_dim=16),
        _qwen2_json(head_dim=16),
        _qwen3_json(head_dim=16),
    ):
        assert hf_config_read.from_hf_config(hf, "x").architecture["kv_channels"] == 16
    assert hf_config_read.from_hf_config(_llama_json(), "x").architecture["kv_channels"] is None  # head_dim 8 = 32 / 4
    assert hf_config_read.from_hf_config({**_llama_json(), "head_dim": None}, "x").architecture["kv_channels"] is None
    no_head_dim = {k: v for k, v in _qwen3_json().items() if k != "head_dim"}
    assert hf_config_read.from_hf_config(no_head_dim, "x").architecture["kv_channels"] == 128  # Qwen3Config's default
    wide = dataclasses.replace(QWEN3, kv_channels=16)
    assert hf_config.to_hf_config(wide, REG, 200, "float32", {})["head_dim"] == 16
    for refused, flag in ((dataclasses.replace(GPT, kv_channels=16), "gpt2"), (PHI3_WIDE, "phi3")):
        with pytest.raises(HFConfigError, match=f"cannot export to Hugging Face {flag}: --kv-channels 16"):
            hf_config.to_hf_config(refused, REG, 200, "float32", {})
    phi3 = hf_config.to_hf_config(dataclasses.replace(PHI3_WIDE, kv_channels=None), REG, 200, "float32", {})
    with pytest.raises(HFConfigError, match="head_dim 16 is not supported: Phi-3's head size"):
        hf_config_read.from_hf_config({**phi3, "head_dim": 16}, "x")


def test_hf_names_cover_every_tensor_once() -> None:
    for arch, model in ((hf_architectures.GPT2, GPT), (hf_architectures.LLAMA, LLAMA)):
        shapes = hf_weights.hf_shapes(arch, model, 200)
        per_layer = {n for n in shapes if ".0." in n}
        assert len(per_layer) == len({n for n in shapes if ".1." in n})
        assert shapes[{"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight"}[arch]] == (200, 32)
    llama = hf_weights.hf_shapes(hf_architectures.LLAMA, LLAMA, 200)
    assert llama["model.layers.0.self_attn.k_proj.weight"] == (16, 32)  # 2 kv heads of 8
    assert llama["model.layers.0.mlp.gate_proj.weight"] == (48, 32)
    assert hf_weights.hf_shapes(hf_architectures.GPT2, GPT, 200)["transformer.h.1.mlp.c_fc.weight"] == (32, 64)


def test_render_flags_inverts_parsing() -> None:
    from megatron_ds.flags.parser import build_parser

    values = {"num_layers": 2, "swiglu": True, "add_position_embedding": False, "normalization": "rmsnorm"}
    flags = hf_config_read.render_flags(values)
    assert flags == ["--num-layers", "2", "--swiglu", "--no-position-embedding", "--normalization", "rmsnorm"]
    parsed = build_parser().parse_known_args(flags)[0]
    assert all(getattr(parsed, k) == v for k, v in values.items())


@pytest.mark.parametrize(
    "model, fields",
    [
        (dataclasses.replace(LLAMA, window_size=(3, 0)), {"model_type": "mistral", "sliding_window": 4}),
        (
            dataclasses.replace(QWEN2, window_size=(3, 0), window_attn_skip_freq=(0, 1)),
            {
                "use_sliding_window": True,
                "sliding_window": 4,
                "max_window_layers": 1,
                "layer_types": ["full_attention", "sliding_attention"],
            },
        ),
        (
            dataclasses.replace(QWEN3, window_size=(0, 0), window_attn_skip_freq=(1, 0)),
            {"use_sliding_window": True, "sliding_window": 1, "layer_types": ["sliding_attention", "full_attention"]},
        ),
    ],
)
def test_a_window_exports_as_transformers_sliding_window_and_reads_back(model: ModelConfig, fields: dict) -> None:
    """--window-size LEFT,0 is sliding_window LEFT + 1 (keys the query sees, itself included); a Llama with one on
    every layer is a Mistral; Qwen2's and Qwen3's layers are named; the import gives the same flags back."""
    hf = hf_config.to_hf_config(model, REG, 200, "float32", {})
    assert {k: hf[k] for k in fields} == fields
    back = hf_config_read.from_hf_config(hf, "x")
    pattern = model.window_attn_skip_freq
    assert _window(back) == (f"{model.window_size[0]},0", None if pattern is None else str(list(pattern)))


@pytest.mark.parametrize(
    "pattern, noted",
    [
        (None, False),  # every layer
        ((0, 1), False),  # the last ones: max_window_layers says it
        ((1, 0), True),  # layer_types alone says it
    ],
)
def test_qwen_sliding_layers_that_are_not_the_last_are_noted_on_export(pattern: tuple | None, noted: bool) -> None:
    model = dataclasses.replace(
        LLAMA, num_layers=2, add_qkv_bias=True, window_size=(15, 0), window_attn_skip_freq=pattern
    )
    hf = hf_config.to_hf_config(model, REG, 200, "float32", {}, hf_architectures.QWEN2)
    older = ["sliding_attention" if i >= hf["max_window_layers"] else "full_attention" for i in range(2)]
    notes = hf_config.export_notes(hf_architectures.QWEN2, model)
    assert bool(notes) == noted == (older != hf["layer_types"])  # noted exactly when an older reader differs
    if noted:
        assert notes[0].startswith("the sliding-window layers are [0] of 0..1") and "transformers >= 4.53" in notes[0]
    assert hf_config.export_notes(hf_architectures.LLAMA, model) == []  # Llama has no window fields
