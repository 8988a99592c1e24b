"""A mixture-of-experts model exports as Hugging Face Mixtral when Mixtral computes the same model, and is refused in
one line naming the flag otherwise; a Mixtral imports as that model (training from one at expert-parallel size 2 and
exporting it back: tests/e2e/test_hf_train_export.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.interop import hf_architectures, hf_config, hf_config_read, hf_weights
from megatron_ds.interop.hf_architectures import HFConfigError

MIXTRAL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    ffn_hidden_size=48,
    seq_length=16,
    max_position_embeddings=32,
    vocab_size=256,
    normalization="rmsnorm",
    activation="swiglu",
    use_rotary_position_embeddings=True,
    add_position_embedding=False,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    num_experts=(4,),
    expert_interval=1,
    moe_top_k=2,
)
REG = RegularizationConfig()


def test_the_config_is_mixtrals_and_transformers_builds_it() -> None:
    transformers = pytest.importorskip("transformers")
    model = dataclasses.replace(MIXTRAL, moe_loss_coeff=0.02, window_size=(7, 0))
    assert hf_architectures.architecture_of(model) == hf_architectures.MIXTRAL
    fields = hf_config.to_hf_config(model, RegularizationConfig(), 200, "float32", {})
    assert fields["architectures"] == ["MixtralForCausalLM"] and fields["model_type"] == "mixtral"
    expected = {"num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "sliding_window": 8}
    assert {k: fields[k] for k in expected} == expected
    built = transformers.MixtralConfig(**{k: v for k, v in fields.items() if k != "architectures"})
    assert (built.num_local_experts, built.num_experts_per_tok, built.intermediate_size) == (4, 2, 48)
    assert (built.head_dim, built.sliding_window, built.router_jitter_noise) == (8, 8, 0.0)


def test_every_expert_has_the_hubs_tensor_names() -> None:
    """The Hub's layout (what Mixtral-8x7B ships and transformers 5 fuses on load): a router and w1 (gate), w3 (up),
    w2 (down) per expert, no dense MLP."""
    shapes = hf_weights.hf_shapes(hf_architectures.MIXTRAL, MIXTRAL, 200)
    moe = "model.layers.{}.block_sparse_moe."
    for layer in range(2):
        assert shapes[moe.format(layer) + "gate.weight"] == (4, 32)
        for e in range(4):
            expert = moe.format(layer) + f"experts.{e}."
            assert (shapes[expert + "w1.weight"], shapes[expert + "w3.weight"]) == ((48, 32), (48, 32))
            assert shapes[expert + "w2.weight"] == (32, 48)
    assert not [n for n in shapes if ".mlp." in n or "experts.4." in n]
    assert len(shapes) == 3 + 2 * (4 + 2 + 1 + 3 * 4)  # embedding, norm, head; per layer attention, norms, router


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"activation": "gelu", "normalization": "layernorm"}, "--normalization layernorm: Llama uses"),
        ({"activation": "gelu"}, "experts with a gelu MLP: Mixtral's experts are SwiGLU"),
        (
            {"expert_interval": 2},
            r"--num-experts 4 --expert-interval 2 \(experts per layer \[1, 4\]\): Mixtral has the same experts",
        ),
        ({"num_experts": (4, 2)}, r"--num-experts 4 2 --expert-interval 1 \(experts per layer \[4, 2\]\)"),
        ({"moe_top_k": 1}, "--topk 1: Mixtral weighs a token's experts by their renormalized scores"),
        (
            {"moe_router": "megatron", "moe_router_pre_softmax": True},
            "--moe-router-pre-softmax: Mixtral renormalizes a token's k weights",
        ),
        ({"mlp_type": "residual"}, "--mlp-type residual: Mixtral has no residual MLP"),
        ({"add_bias_linear": True}, r"biases \(no --disable-bias-linear\): Mixtral has none"),
        ({"add_qkv_bias": True}, "--add-qkv-bias: of these types only Qwen2"),
        ({"rotary_percent": 0.5}, "--rotary-percent 0.5: Mixtral rotates whole heads"),
        ({"window_size": (3, 0), "window_attn_skip_freq": (1, 0)}, "--window-attn-skip-freq: Mixtral's sliding"),
    ],
)
def test_what_mixtral_cannot_express_is_one_line(change: dict, problem: str) -> None:
    """(With --qk-layernorm the model is Qwen3-MoE's: tests/unit/test_hf_qwen3_moe.py.)"""
    with pytest.raises(HFConfigError, match="cannot export to Hugging Face mixtral: " + problem) as err:
        hf_architectures.architecture_of(dataclasses.replace(MIXTRAL, **change))
    assert "\n" not in str(err.value)


def test_another_model_type_is_refused_both_ways() -> None:
    with pytest.raises(HFConfigError, match="--hf-model-type llama: the checkpoint's model exports as mixtral only"):
        hf_architectures.architecture_of(MIXTRAL, "llama")
    dense = dataclasses.replace(MIXTRAL, num_experts=(1,))
    with pytest.raises(HFConfigError, match="--hf-model-type mixtral: the checkpoint's model exports as llama only"):
        hf_architectures.architecture_of(dense, "mixtral")


def test_the_notes_say_how_the_training_gate_routed_otherwise() -> None:
    notes = hf_config.export_notes(hf_architectures.MIXTRAL, MIXTRAL)
    assert len(notes) == 3 and all("\n" not in n for n in notes)
    assert "training dropped the tokens over each expert's capacity (--moe-train-capacity-factor 1)" in notes[0]
    assert "training sampled each token's second expert" in notes[1]
    assert (
        "router_aux_loss_coef is --moe-loss-coeff 0.1, but the losses differ: ours sums each of the 2 MoE" in notes[2]
    )
    assert notes[2].endswith("at one coefficient ours weighs balancing about 1 x as much")
    undropped = dataclasses.replace(MIXTRAL, moe_token_dropping=False, moe_top2_2nd_expert_sampling=False)
    assert [n.split(" ", 1)[0] for n in hf_config.export_notes(hf_architectures.MIXTRAL, undropped)] == [
        "router_aux_loss_coef"
    ]


def test_mixtrals_config_reads_back_as_the_model_and_its_routing() -> None:
    """The experts as architecture (flags that contradict them are errors); the routing that computes Mixtral's model
    (every token routed, the second expert the best other one) as flags a later launch may change."""
    from megatron_ds.interop.hf_import import config_from_hf

    fields = hf_config.to_hf_config(dataclasses.replace(MIXTRAL, moe_loss_coeff=0.02), REG, 200, "float32", {})
    hf = hf_config_read.from_hf_config(fields, "hf/config.json")
    assert hf.arch == hf_architectures.MIXTRAL
    moe = {k: hf.architecture[k] for k in ("num_experts", "expert_interval", "topk", "mlp_type")}
    assert moe == {"num_experts": [4], "expert_interval": 1, "topk": 2, "mlp_type": "standard"}
    model = config_from_hf(hf, ["--seq-length", "16"], "hf/config.json", None).model
    routing = dict(moe_token_dropping=False, moe_top2_2nd_expert_sampling=False, moe_loss_coeff=0.02)
    assert model == dataclasses.replace(MIXTRAL, vocab_size=256, rotary_base=10000.0, **routing)
    with pytest.raises(HFConfigError, match=r"--num-experts 8 contradicts hf/config.json \(4\); drop the flag"):
        config_from_hf(hf, ["--num-experts", "8"], "hf/config.json", None)


def test_a_top_1_mixtral_imports_as_megatron_lms_top_1_router_without_its_notice(capsys: pytest.CaptureFixture) -> None:
    """num_experts_per_tok 1: the one expert weighed 1 (the softmax over the one chosen logit), Megatron-LM's router
    without --moe-router-pre-softmax, which megatron-core refuses; the launch's notice says so, the import's not."""
    from megatron_ds.interop.hf_import import config_from_hf

    fields = hf_config.to_hf_config(MIXTRAL, REG, 200, "float32", {})
    hf = hf_config_read.from_hf_config({**fields, "num_experts_per_tok": 1}, "hf/config.json")
    assert hf.architecture["moe_router_topk"] == 1
    capsys.readouterr()
    model = config_from_hf(hf, ["--seq-length", "16"], "hf/config.json", None).model
    assert (model.moe_router, model.moe_top_k, model.moe_router_pre_softmax) == ("megatron", 1, False)
    assert "NOTICE" not in capsys.readouterr().out


def test_absent_fields_are_mixtrals_defaults_not_llamas() -> None:
    """transformers' MixtralConfig: rms_norm_eps 1e-5, rope base 1e6 (its default_theta), 8 key/value heads."""
    fields = hf_config.to_hf_config(dataclasses.replace(MIXTRAL, num_attention_heads=8), REG, 200, "float32", {})
    absent = ("rms_norm_eps", "rope_theta", "rope_scaling", "num_key_value_heads", "head_dim")
    hf = hf_config_read.from_hf_config({k: v for k, v in fields.items() if k not in absent}, "hf/config.json")
    got = {k: hf.architecture[k] for k in ("layernorm_epsilon", "rotary_base", "num_key_value_heads")}
    assert got == {"layernorm_epsilon": 1e-5, "rotary_base": 1e6, "num_key_value_heads": 8}


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than num_local_experts 4"),
        ({"router_jitter_noise": 0.1}, "router_jitter_noise 0.1 is not supported: the router's training-time"),
        ({"num_local_experts": 1}, "num_local_experts 1: a mixture of experts needs 2 or more"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported: mixtral's MLP here is SwiGLU"),
    ],
)
def test_what_we_do_not_build_is_one_line_on_import(change: dict, problem: str) -> None:
    fields = {**hf_config.to_hf_config(MIXTRAL, REG, 200, "float32", {}), **change}
    with pytest.raises(HFConfigError, match="hf/config.json: " + problem) as err:
        hf_config_read.from_hf_config(fields, "hf/config.json")
    assert "\n" not in str(err.value)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
HF_CASES = {
    "tied, a window": dict(sliding_window=6, tie_word_embeddings=True),
    "top-3 (Megatron-LM's router)": dict(num_experts_per_tok=3),
    "Llama 3.x rope scaling": dict(  # head size 32: frequencies in all three of the scaling's bands
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16384,
        rope_parameters={**LLAMA3_ROPE, "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", HF_CASES)
def test_transformers_mixtral_imports_computes_its_logits_and_exports_back_bit_identical(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from megatron_ds.inference import load_model
    from megatron_ds.interop.hf_export import export_hf
    from megatron_ds.interop.hf_import import import_hf

    torch.manual_seed(0)
    sizes = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config = transformers.MixtralConfig(
        vocab_size=200, intermediate_size=48, num_hidden_layers=2, num_local_experts=4, initializer_range=0.1,
        **{**sizes, **HF_CASES[case]},
    )  # fmt: skip
    theirs = transformers.MixtralForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path / "hf")
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), [], show_progress=False)
    flags = {"--window-size", "--untie-embeddings-and-output-weights", "--use-rope-scaling"} & set(result.train_flags)
    expected = {"--untie-embeddings-and-output-weights"} | ({"--use-rope-scaling"} if "rope" in case else set())
    assert flags == ({"--window-size"} if "window" in case else expected)
    assert ("--moe-router-topk" in result.train_flags) == ("top-3" in case)  # top-2: DeepSpeed's top-2 gate
    assert len(result.notes) == 1 and "the losses differ" in result.notes[0]
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (load_model(str(tmp_path / "ours"))(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff
    if "window" in case:  # the tool says where the experts load and what --moe-loss-coeff weighs
        from megatron_ds.data.demo_corpus import _load_tool

        capsys.readouterr()
        assert _load_tool("convert_checkpoint").main(["--from", "hf", str(tmp_path / "hf"), str(tmp_path / "cli")]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].endswith("(weights only, in universal form: loads at any pipeline size, layout, world size "
                               "and --moe-expert-parallel-size)")  # fmt: skip
        assert out[1].startswith("note: router_aux_loss_coef is --moe-loss-coeff 0.001, but the losses differ")
    with pytest.raises(HFConfigError, match="--moe-expert-parallel-size 2: the import writes every expert"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "p2"), ["--moe-expert-parallel-size", "2"])
    assert not (tmp_path / "p2").exists()
    export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), show_progress=False)
    original, back = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "back"))
    assert sorted(original) == sorted(back) and all(torch.equal(original[k], back[k]) for k in original)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()  # its config.json too
    with torch.no_grad():
        assert (again(tokens).logits - theirs(tokens).logits).abs().max().item() <= 1e-5
