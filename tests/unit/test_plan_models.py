"""The planner's models: pretrain_gpt.py's architecture flags from their declarations, the model built by
pretrain_gpt.py's own flag rules, Llama presets at their published sizes, the printed command training
what was planned."""

from __future__ import annotations

import json
import shlex

import pytest

from megatron_ds.flags.parser import parse_config
from megatron_ds.model.shapes import total_params
from megatron_ds.plan import hardware
from megatron_ds.plan.__main__ import main
from megatron_ds.plan.inputs import PlanInputs, resolve

PUBLISHED_BILLIONS = {
    # Touvron et al. 2023 (Llama 2) and the released configs: 6.74B, 13.0B, 69.0B; Llama 3 and 3.1: 8.03B,
    # 70.6B, 405.9B; Llama 3.2 (tied): 1.24B, 3.21B
    "llama2-7b": 6.738,
    "llama2-13b": 13.016,
    "llama2-70b": 68.977,
    "llama3-8b": 8.030,
    "llama3-70b": 70.554,
    "llama3.1-8b": 8.030,
    "llama3.1-70b": 70.554,
    "llama3-405b": 405.853,
    "llama3.2-1b": 1.236,
    "llama3.2-3b": 3.213,
    # Qwen2.5 model cards: 7.61B, 72.7B (7,615,616,512 and 72,706,203,648 in their safetensors indexes); Mistral
    # 7B v0.1: 7,241,732,096
    "qwen2.5-7b": 7.6156,
    "qwen2.5-72b": 72.7062,
    "mistral-7b": 7.2417,
    # Mixtral 8x7B v0.1 (Jiang et al. 2024): 46.7B, its model card; 46,702,792,704 from its config.json. 8x22B: 141B
    # (Mistral AI's release), 140,630,071,296 from its config.json
    "mixtral-8x7b": 46.7028,
    "mixtral-8x22b": 140.6301,
}
QWEN = {"qwen2.5-7b", "qwen2.5-72b", "qwen1.5-moe-a2.7b"}
# Released config.json: rope_scaling (llama3) factor, or None; tie_word_embeddings
ROPE_SCALING = {"llama3.1-8b": 8.0, "llama3.1-70b": 8.0, "llama3-405b": 8.0, "llama3.2-1b": 32.0, "llama3.2-3b": 32.0}
TIED = {"llama3.2-1b", "llama3.2-3b"}


@pytest.mark.parametrize("name", sorted(PUBLISHED_BILLIONS))
def test_llama_class_presets_have_their_published_parameter_counts(name: str) -> None:
    res = resolve(PlanInputs(model=name))
    assert total_params(res.model()) / 1e9 == pytest.approx(
        PUBLISHED_BILLIONS[name], rel=2e-3 if "llama" in name else 1e-5
    )
    m = res.model()
    assert m.add_qkv_bias == (name in QWEN) and m.rotary_base == (1e6 if name in QWEN else m.rotary_base)
    assert m.layernorm_epsilon == (1e-6 if name in QWEN else 1e-5)
    assert m.activation == "swiglu" and m.normalization == "rmsnorm"
    assert m.untie_embeddings_and_output_weights == (name not in TIED)
    assert m.use_rotary_position_embeddings and not m.add_position_embedding and not m.add_bias_linear
    assert m.use_rope_scaling == (name in ROPE_SCALING)
    if name in ROPE_SCALING:
        assert m.rope_scaling_factor == ROPE_SCALING[name]


# Qwen3 (arXiv 2505.09388, the model cards): total and non-embedding billions; 0.6B-4B as the exact counts of
# keras-hub's Qwen3 presets (596,049,920, 1,720,574,976, 4,022,468,096), whose cards say 0.6B, 1.7B and 4.0B
QWEN3_BILLIONS = {
    "qwen3-0.6b": (0.59605, 0.44),
    "qwen3-1.7b": (1.72057, 1.4),
    "qwen3-4b": (4.02247, 3.6),
    "qwen3-8b": (8.2, 6.95),
    "qwen3-14b": (14.8, 13.2),
    "qwen3-32b": (32.8, 31.2),
}
QWEN3_TIED = {"qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"}


@pytest.mark.parametrize("name", sorted(QWEN3_BILLIONS))
def test_qwen3_presets_have_their_published_parameter_counts(name: str) -> None:
    m = resolve(PlanInputs(model=name)).model()
    total, body = QWEN3_BILLIONS[name]
    embeddings = 151936 * m.hidden_size * (1 if name in QWEN3_TIED else 2)
    assert total_params(m) / 1e9 == pytest.approx(total, rel=1e-2 if total > 5 else 1e-5)
    assert (total_params(m) - embeddings) / 1e9 == pytest.approx(body, rel=1e-2)
    assert m.qk_layernorm and not m.add_qkv_bias and not m.add_bias_linear and m.kv_heads == 8
    assert (m.head_dim, m.rotary_base, m.layernorm_epsilon) == (128, 1e6, 1e-6)
    assert m.activation == "swiglu" and m.normalization == "rmsnorm" and not m.add_position_embedding
    assert m.untie_embeddings_and_output_weights == (name not in QWEN3_TIED)
    assert hardware.find_preset("Qwen3-" + name.split("-")[1].upper()).name == name  # Qwen3-0.6B, ...


@pytest.mark.parametrize(
    ("name", "gpus"),
    [
        ("llama3.2-1b", 8),
        ("llama3-405b", 1024),
        ("qwen2.5-7b", 16),
        ("qwen3-0.6b", 8),
        ("qwen3-32b", 64),
        ("mixtral-8x7b", 64),
        ("qwen3-30b-a3b", 64),
        ("qwen1.5-moe-a2.7b", 16),
    ],
)
def test_a_llama_presets_printed_command_trains_its_model(name: str, gpus: int, capsys) -> None:
    """RoPE scaling, tied embeddings, q/k/v biases and the norm epsilon reach the printed pretrain_gpt.py line, not
    only the planner's model."""
    rc = main(["pipeline", "--model", name, "--num-gpus", str(gpus), "--gpu", "H100-80GB", "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    sec = next(s for s in report["sections"] if s["name"] == "pipeline")
    tokens = shlex.split(sec["snippets"]["command"].split("\n", 1)[1].replace("\\\n", " "))
    config, _ = parse_config(tokens[tokens.index("pretrain_gpt.py") + 1 :], world_size=gpus)
    assert config.model == resolve(PlanInputs(model=name)).model(sec["data"]["tensor_parallel"])
    assert config.model.use_rope_scaling == (name in ROPE_SCALING)
    assert config.model.rope_scaling_factor == ROPE_SCALING.get(name, config.model.rope_scaling_factor)
    assert config.model.add_qkv_bias == (name in QWEN)
    assert config.model.qk_layernorm == name.startswith("qwen3")
    assert ("--kv-channels" in tokens) == (name in {"qwen3-0.6b", "qwen3-32b", "qwen3-30b-a3b"})  # h / heads is not 128


@pytest.mark.parametrize(("name", "active"), [("Mixtral-8x7B", 12.88), ("Mixtral-8x22B", 39.16)])
def test_the_mixtral_presets_are_the_released_models_and_export_as_mixtral(name: str, active: float) -> None:
    """8 experts of the layer's MLP on every layer, top-2, every token routed (transformers' Mixtral): the model the
    Hugging Face export writes as MixtralForCausalLM; its active parameters are the published 12.9B and 39B."""
    from megatron_ds.interop import hf_architectures

    m = resolve(PlanInputs(model=name)).model()
    assert m.experts_per_layer == (8,) * m.num_layers and m.moe_top_k == 2 and m.kv_heads == 8
    assert not m.moe_token_dropping and not m.moe_top2_2nd_expert_sampling and m.rotary_base == 1e6
    assert hf_architectures.architecture_of(m) == hf_architectures.MIXTRAL
    idle_experts = m.num_layers * 6 * 3 * m.hidden_size * m.ffn_hidden_size  # 6 of a layer's 8 compute no token
    assert (total_params(m) - idle_experts) / 1e9 == pytest.approx(active, rel=1e-3)


def test_the_qwen3_8b_plan_prints_every_default_section(capsys) -> None:
    """`python -m megatron_ds.plan --model qwen3-8b --num-gpus 8 --gpu H100-80GB`: every default section."""
    assert main(["--model", "qwen3-8b", "--num-gpus", "8", "--gpu", "H100-80GB", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in report["sections"]] == ["zero", "precision", "pipeline", "memory"]


def test_preset_names_are_forgiving_and_gpt3_sizes_unchanged() -> None:
    assert hardware.find_preset("Llama-2-7B").name == "llama2-7b"
    assert hardware.find_preset("Llama-3.1-405B").name == "llama3-405b"
    assert hardware.find_preset("Llama-3.2-1B").name == "llama3.2-1b"
    assert hardware.find_preset("Llama-3.3-70B").name == "llama3.1-70b"
    assert hardware.find_preset("Llama-3.1-8B").name == "llama3.1-8b"
    assert (
        hardware.find_preset("Qwen2.5-72B").name == "qwen2.5-72b"
        and hardware.find_preset("Mistral-7B").name == "mistral-7b"
    )
    assert hardware.find_preset("175b").name == "gpt3-175b" and hardware.find_preset("1.3B").name == "gpt3-1.3b"
    assert total_params(resolve(PlanInputs(model="1.3b")).model()) / 1e9 == pytest.approx(1.32, abs=0.01)


def test_architecture_flags_reach_the_model_as_pretrain_gpt_builds_it(capsys) -> None:
    arch = [
        "--swiglu",
        "--num-key-value-heads",
        "4",
        "--normalization",
        "RMSNorm",
        "--untie-embeddings-and-output-weights",
    ]
    rc = main(["pipeline", "--model", "1.3b", "--num-gpus", "8", "--gpu", "A100-80GB", *arch, "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    sec = next(s for s in report["sections"] if s["name"] == "pipeline")
    command = sec["snippets"]["command"].split("\n", 1)[1]
    tokens = shlex.split(command.replace("\\\n", " "))
    argv = tokens[tokens.index("pretrain_gpt.py") + 1 :]
    config, _ = parse_config(argv, world_size=8)
    assert config.model == resolve(PlanInputs(model="1.3b", architecture=arch)).model(sec["data"]["tensor_parallel"])
    assert config.model.kv_heads == 4 and config.model.activation == "swiglu"


QWEN3_06B = ["--num-layers", "28", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "4096"]
QWEN3_06B += ["--vocab-size", "151936", "--ffn-hidden-size", "3072", "--global-batch-size", "64"]
QWEN3_06B_ARCH = ["--swiglu", "--num-key-value-heads", "8", "--kv-channels", "128", "--qk-layernorm"]
QWEN3_06B_ARCH += ["--normalization", "RMSNorm", "--disable-bias-linear", "--use-rotary-position-embeddings"]
QWEN3_06B_ARCH += ["--no-position-embedding", "--make-vocab-size-divisible-by", "1"]
"""Qwen3-0.6B's config.json as flags: head_dim 128 beside hidden / heads = 64, tied embeddings."""


def test_kv_channels_size_the_planned_model_and_reach_the_printed_command(capsys) -> None:
    sizes = dict(num_layers=28, hidden_size=1024, num_attention_heads=16, seq_length=4096, vocab_size=151936)
    model = resolve(PlanInputs(**sizes, ffn_hidden_size=3072, architecture=QWEN3_06B_ARCH)).model()
    # its model card: 0.44B parameters besides the (tied) embedding; 28 x (q, k, v, o of 128-channel heads, the
    # SwiGLU MLP, two norms and the 128-wide q/k norms) + the final norm
    assert (model.head_dim, model.query_size) == (128, 2048)
    assert total_params(model) - 151936 * 1024 == 28 * (6_291_456 + 9_437_184 + 2 * 1024 + 2 * 128) + 1024
    rc = main(["pipeline", *QWEN3_06B, *QWEN3_06B_ARCH, "--num-gpus", "8", "--gpu", "H100", "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    sec = next(s for s in report["sections"] if s["name"] == "pipeline")
    tokens = shlex.split(sec["snippets"]["command"].split("\n", 1)[1].replace("\\\n", " "))
    config, _ = parse_config(tokens[tokens.index("pretrain_gpt.py") + 1 :], world_size=8)
    assert config.model == model and "--kv-channels" in tokens


def test_a_bad_architecture_value_is_one_line(capsys) -> None:
    assert main(["pipeline", "--model", "1.3b", "--num-key-value-heads", "5", "--num-gpus", "8", "--gpu", "H100"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: --num-key-value-heads 5 must divide --num-attention-heads 16")
        and "\n" not in err.strip()
    )


def test_the_long_guides_run_only_when_named(capsys) -> None:
    main(["--model", "1.3b", "--num-gpus", "8", "--gpu", "A100-80GB", "--format", "json"])
    names = [s["name"] for s in json.loads(capsys.readouterr().out)["sections"]]
    assert names == ["zero", "precision", "pipeline", "memory"]
    main(["--model", "1.3b", "--num-gpus", "8", "--gpu", "A100-80GB"])
    assert len(capsys.readouterr().out.splitlines()) < 260  # 404 lines with the guides
    assert main(["nvme"]) == 0 and "DeepNVMe" in capsys.readouterr().out


def test_megatron_lm_spellings_and_squared_relu_reach_the_printed_command(capsys) -> None:
    """An alias (Megatron-LM's --norm-epsilon) is taken as pretrain_gpt.py takes it; the command spells it ours."""
    arch = ["--squared-relu", "--norm-epsilon", "1e-6", "--use-rotary-position-embeddings"]
    arch += ["--rotary-position-embeddings-theta", "20000"]  # Megatron-DeepSpeed's name of --rotary-base
    rc = main(["pipeline", "--model", "1.3b", "--num-gpus", "8", "--gpu", "H100", *arch, "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    sec = next(s for s in report["sections"] if s["name"] == "pipeline")
    command = sec["snippets"]["command"].split("\n", 1)[1]
    assert "--layernorm-epsilon 1e-06" in command and "--squared-relu" in command
    tokens = shlex.split(command.replace("\\\n", " "))
    config, _ = parse_config(tokens[tokens.index("pretrain_gpt.py") + 1 :], world_size=8)
    assert config.model.activation == "squared_relu" and config.model.layernorm_epsilon == 1e-6
    assert config.model.rotary_base == 20000


def test_an_ignored_architecture_flag_is_warned_about_once(capsys) -> None:
    """The planner sizes the model at every tensor-parallel size it tries; pretrain_gpt.py's warning comes once."""
    assert main(["pipeline", "--model", "1.3b", "--num-gpus", "8", "--gpu", "H100", "--rotary-base", "20001"]) == 0
    err = capsys.readouterr().err
    assert err.count("WARNING: --rotary-base 20001 only applies with --use-rotary-position-embeddings") == 1


@pytest.mark.parametrize(("name", "total", "active"), [("Qwen3-30B-A3B", 30.5, 3.3), ("Qwen3-235B-A22B", 235.1, 22.1)])
def test_the_qwen3_moe_presets_are_the_released_models_and_export_as_qwen3_moe(
    name: str, total: float, active: float
) -> None:
    """128 experts of moe_intermediate_size on every layer, 8 routed by Megatron-LM's top-k router (the renormalized
    softmax of norm_topk_prob): the model the Hugging Face export writes as Qwen3MoeForCausalLM, at the model cards'
    30.5B / 235B parameters and 3.3B / 22B active (counted here: 3.353B and 22.1B)."""
    from megatron_ds.interop import hf_architectures

    m = resolve(PlanInputs(model=name)).model()
    assert m.experts_per_layer == (128,) * m.num_layers and m.moe_router == "megatron" and m.moe_top_k == 8
    assert (m.kv_heads, m.head_dim, m.qk_layernorm, m.moe_loss_coeff) == (4, 128, True, 0.0)
    assert hf_architectures.architecture_of(m) == hf_architectures.QWEN3_MOE
    idle_experts = m.num_layers * 120 * 3 * m.hidden_size * m.ffn_hidden_size  # 120 of a layer's 128 compute no token
    assert total_params(m) / 1e9 == pytest.approx(total, rel=2e-3)
    assert (total_params(m) - idle_experts) / 1e9 == pytest.approx(active, rel=2e-2)  # 3.353B: the card's "3.3B"


@pytest.mark.parametrize(
    ("name", "experts", "routed", "total", "active"),
    [("Qwen1.5-MoE-A2.7B", 60, 4, 14.3, 2.7), ("Qwen2-57B-A14B", 64, 8, 57.4, 14.2)],
)
def test_the_qwen2_moe_presets_are_the_released_models_and_export_as_qwen2_moe(
    name: str, experts: int, routed: int, total: float, active: float
) -> None:
    """Qwen2's layer with routed experts on every layer (the k largest of a softmax over all of them, not renormalized:
    norm_topk_prob false) and a gated shared expert: the model the Hugging Face export writes as Qwen2MoeForCausalLM,
    at the model cards' parameters (counted here: 14.32B / 2.69B active and 57.41B / 14.25B)."""
    from megatron_ds.interop import hf_architectures

    m = resolve(PlanInputs(model=name)).model()
    assert m.experts_per_layer == (experts,) * m.num_layers and (m.moe_router, m.moe_top_k) == ("megatron", routed)
    assert m.moe_router_pre_softmax and m.moe_shared_expert_gate and m.add_qkv_bias and not m.qk_layernorm
    assert hf_architectures.architecture_of(m) == hf_architectures.QWEN2_MOE
    idle_experts = m.num_layers * (experts - routed) * 3 * m.hidden_size * m.ffn_hidden_size
    assert total_params(m) / 1e9 == pytest.approx(total, rel=2e-3)
    assert (total_params(m) - idle_experts) / 1e9 == pytest.approx(active, rel=5e-3)
