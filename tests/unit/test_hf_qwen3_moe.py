"""Qwen3-MoE in and out of Hugging Face: Qwen3's layer (query and key norms) with experts on every layer, routed by
Megatron-LM's top-k router (`norm_topk_prob`: the softmax renormalized over the k chosen; false:
`--moe-router-pre-softmax`). A transformers-made model
imports, computes its logits, exports back bit for bit; what Qwen3-MoE cannot say is one line naming the flag or the
config.json field."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.interop import hf_architectures, hf_config, hf_config_read
from megatron_ds.interop.hf_architectures import QWEN3_MOE, HFConfigError

QWEN3_MOE_MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    kv_channels=16,
    ffn_hidden_size=48,
    seq_length=16,
    max_position_embeddings=64,
    vocab_size=256,
    normalization="rmsnorm",
    activation="swiglu",
    use_rotary_position_embeddings=True,
    add_position_embedding=False,
    add_bias_linear=False,
    qk_layernorm=True,
    untie_embeddings_and_output_weights=True,
    num_experts=(4,),
    expert_interval=1,
    moe_router="megatron",
    moe_top_k=3,
    moe_loss_coeff=0.01,
)
REG = RegularizationConfig()


def test_experts_with_query_and_key_norms_are_qwen3_moe_and_its_config_says_so() -> None:
    assert hf_architectures.architecture_of(QWEN3_MOE_MODEL) == QWEN3_MOE
    fields = hf_config.to_hf_config(QWEN3_MOE_MODEL, REG, 200, "float32", {})
    assert fields["architectures"] == ["Qwen3MoeForCausalLM"]
    moe = {k: fields[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")}
    assert moe == {"num_experts": 4, "num_experts_per_tok": 3, "moe_intermediate_size": 48, "norm_topk_prob": True}
    assert (fields["decoder_sparse_step"], fields["mlp_only_layers"], fields["use_sliding_window"]) == (1, [], False)
    back = hf_config_read.from_hf_config(fields, "hf/config.json")
    assert back.architecture["moe_router_topk"] == 3 and back.defaults["moe_aux_loss_coeff"] == 0.01
    assert back.architecture["ffn_hidden_size"] == 48 and back.architecture["qk_layernorm"]


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"window_size": (5, 0), "window_attn_skip_freq": (1, 0)}, "--window-attn-skip-freq: Qwen3-MoE's sliding "
         "window is on every layer"),
        ({"num_experts": (4, 8)}, "--num-experts 4 8 --expert-interval 1 (experts per layer [4, 8]): Qwen3-MoE has"),
        ({"moe_router": "deepspeed", "moe_top_k": 1}, "--topk 1: Qwen3-MoE weighs a token's experts by their "
         "renormalized scores"),
        ({"rotary_percent": 0.5}, "--rotary-percent 0.5: Qwen3-MoE rotates whole heads"),
        ({"moe_shared_expert_size": 16}, "--moe-shared-expert-intermediate-size 16: Qwen3-MoE has no shared expert"),
    ],
)  # fmt: skip
def test_what_qwen3_moe_cannot_express_is_one_line(change: dict, problem: str) -> None:
    with pytest.raises(HFConfigError, match=re.escape("cannot export to Hugging Face qwen3_moe: " + problem)):
        hf_architectures.architecture_of(dataclasses.replace(QWEN3_MOE_MODEL, **change))


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step 2 is not supported: experts on every layer only"),
        ({"mlp_only_layers": [1]}, r"mlp_only_layers \[1\] is not supported: experts on every layer only"),
        ({"num_experts": 1}, "num_experts 1: a mixture of experts needs 2 or more"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than num_experts 4"),
        ({"attention_bias": True}, "attention_bias True is not supported"),
    ],
)
def test_what_we_do_not_build_is_one_line_on_import(change: dict, problem: str) -> None:
    fields = {**hf_config.to_hf_config(QWEN3_MOE_MODEL, REG, 200, "float32", {}), **change}
    with pytest.raises(HFConfigError, match="hf/config.json: " + problem) as err:
        hf_config_read.from_hf_config(fields, "hf/config.json")
    assert "\n" not in str(err.value)


CASES = {
    "k 3 of 4": {},
    "tied, a window on every layer, k 2": dict(
        tie_word_embeddings=True, use_sliding_window=True, sliding_window=6, num_experts_per_tok=2
    ),
    "not renormalized (--moe-router-pre-softmax), k 2": dict(norm_topk_prob=False, num_experts_per_tok=2),
}


@pytest.mark.parametrize("case", CASES)
def test_transformers_qwen3_moe_imports_computes_its_logits_and_exports_back_bit_identical(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from megatron_ds.inference import load_model
    from megatron_ds.interop.hf_export import export_hf
    from megatron_ds.interop.hf_import import import_hf

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=200, hidden_size=32, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, initializer_range=0.1,
        max_position_embeddings=64, **{"num_experts_per_tok": 3, "norm_topk_prob": True, **CASES[case]},
    )  # fmt: skip
    theirs = transformers.Qwen3MoeForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), [], show_progress=False)
    assert "NOTICE" not in capsys.readouterr().out  # the import's own flags: no launch notices
    flags = result.train_flags
    assert flags[flags.index("--moe-router-topk") + 1] == str(config.num_experts_per_tok) and "--qk-layernorm" in flags
    assert ("--window-size" in flags) == ("window" in case) and "--topk" not in flags
    assert ("--moe-router-pre-softmax" in flags) == (not config.norm_topk_prob)
    assert len(result.notes) == 1 and "router_aux_loss_coef is --moe-aux-loss-coeff 0.001" in result.notes[0]
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (load_model(str(tmp_path / "ours"))(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff
    exported = export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), show_progress=False)
    assert exported.arch == QWEN3_MOE
    original, back = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "back"))
    assert sorted(original) == sorted(back) and all(torch.equal(original[k], back[k]) for k in original)
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["norm_topk_prob"] is config.norm_topk_prob and written["model_type"] == QWEN3_MOE
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()  # its config.json too
    with torch.no_grad():
        assert (again(tokens).logits - theirs(tokens).logits).abs().max().item() <= 1e-5


def test_an_import_at_an_expert_parallel_size_is_refused_naming_the_flag(tmp_path: Path) -> None:
    from megatron_ds.interop.hf_import import import_hf

    (tmp_path / "hf").mkdir()
    fields = hf_config.to_hf_config(QWEN3_MOE_MODEL, REG, 200, "float32", {})
    (tmp_path / "hf" / "config.json").write_text(json.dumps(fields))
    with pytest.raises(HFConfigError, match="--expert-model-parallel-size 2: the import writes every expert"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "out"), ["--expert-model-parallel-size", "2"])
    assert not (tmp_path / "out").exists()
