"""Qwen2-MoE in and out of Hugging Face: Qwen2's layer (q/k/v biases) with experts on every layer and a gated shared
expert beside them (`--moe-shared-expert-intermediate-size N --moe-shared-expert-gate`), routed by Megatron-LM's top-k
router: `norm_topk_prob` false is `--moe-router-pre-softmax`. A transformers-made model imports, computes its logits,
exports back bit for bit; what Qwen2-MoE cannot say is one line naming the flag or the config.json field."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from megatron_ds.config import ModelConfig, RegularizationConfig
from megatron_ds.interop import hf_architectures, hf_config, hf_config_read
from megatron_ds.interop.hf_architectures import QWEN2_MOE, HFConfigError

QWEN2_MOE_MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    ffn_hidden_size=48,
    seq_length=16,
    max_position_embeddings=64,
    vocab_size=256,
    normalization="rmsnorm",
    activation="swiglu",
    use_rotary_position_embeddings=True,
    add_position_embedding=False,
    add_bias_linear=False,
    add_qkv_bias=True,
    untie_embeddings_and_output_weights=True,
    num_experts=(4,),
    expert_interval=1,
    moe_router="megatron",
    moe_top_k=2,
    moe_router_pre_softmax=True,
    moe_shared_expert_size=40,
    moe_shared_expert_gate=True,
    moe_loss_coeff=0.01,
)
REG = RegularizationConfig()


def test_experts_beside_a_gated_shared_expert_are_qwen2_moe_and_its_config_says_so() -> None:
    assert hf_architectures.architecture_of(QWEN2_MOE_MODEL) == QWEN2_MOE
    fields = hf_config.to_hf_config(QWEN2_MOE_MODEL, REG, 200, "float32", {})
    assert fields["architectures"] == ["Qwen2MoeForCausalLM"]
    keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
    assert {k: fields[k] for k in keys} == dict(zip(keys, (4, 2, 48, 40), strict=True))
    assert (fields["norm_topk_prob"], fields["qkv_bias"], fields["use_sliding_window"]) == (False, True, False)
    back = hf_config_read.from_hf_config(fields, "hf/config.json")
    shared = {k: back.architecture[k] for k in ("moe_shared_expert_intermediate_size", "moe_shared_expert_gate")}
    assert shared == {"moe_shared_expert_intermediate_size": 40, "moe_shared_expert_gate": True}
    assert back.architecture["moe_router_pre_softmax"] and back.architecture["add_qkv_bias"]
    renormalized = dataclasses.replace(QWEN2_MOE_MODEL, moe_router_pre_softmax=False)
    fields = hf_config.to_hf_config(renormalized, REG, 200, "float32", {})
    assert fields["norm_topk_prob"] is True
    assert "moe_router_pre_softmax" not in hf_config_read.from_hf_config(fields, "hf/config.json").architecture


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"moe_shared_expert_gate": False}, "--moe-shared-expert-intermediate-size without --moe-shared-expert-gate: "
         "Qwen2-MoE's shared expert is gated"),
        ({"add_qkv_bias": False}, "no --add-qkv-bias: Qwen2-MoE has q/k/v biases"),
        ({"num_experts": (4, 8)}, "--num-experts 4 8 --expert-interval 1 (experts per layer [4, 8]): Qwen2-MoE has"),
        ({"window_size": (5, 0)}, "--window-size: this type has no sliding window here"),
    ],
)  # fmt: skip
def test_what_qwen2_moe_cannot_express_is_one_line(change: dict, problem: str) -> None:
    with pytest.raises(HFConfigError, match=re.escape("cannot export to Hugging Face qwen2_moe: " + problem)):
        hf_architectures.architecture_of(dataclasses.replace(QWEN2_MOE_MODEL, **change))


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step 2 is not supported: experts on every layer only"),
        ({"mlp_only_layers": [1]}, r"mlp_only_layers \[1\] is not supported: experts on every layer only"),
        ({"use_sliding_window": True}, "use_sliding_window True is not supported: Qwen2-MoE's sliding window"),
        ({"qkv_bias": False}, "qkv_bias False is not supported: Qwen2-MoE without q/k/v biases"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than num_experts 4"),
    ],
)
def test_what_we_do_not_build_is_one_line_on_import(change: dict, problem: str) -> None:
    fields = {**hf_config.to_hf_config(QWEN2_MOE_MODEL, REG, 200, "float32", {}), **change}
    with pytest.raises(HFConfigError, match="hf/config.json: " + problem) as err:
        hf_config_read.from_hf_config(fields, "hf/config.json")
    assert "\n" not in str(err.value)


CASES = {
    "pre-softmax, k 2": {"norm_topk_prob": False, "num_experts_per_tok": 2},
    "renormalized, k 3, tied": {"norm_topk_prob": True, "num_experts_per_tok": 3, "tie_word_embeddings": True},
}


@pytest.mark.parametrize("case", CASES)
def test_transformers_qwen2_moe_imports_computes_its_logits_and_exports_back_bit_identical(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from megatron_ds.inference import load_model
    from megatron_ds.interop.hf_export import export_hf
    from megatron_ds.interop.hf_import import import_hf

    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=200, hidden_size=32, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, shared_expert_intermediate_size=40,
        initializer_range=0.1, max_position_embeddings=64, **CASES[case],
    )  # fmt: skip
    theirs = transformers.Qwen2MoeForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), [], show_progress=False)
    assert "NOTICE" not in capsys.readouterr().out  # the import's own flags: no launch notices
    flags = result.train_flags
    assert flags[flags.index("--moe-router-topk") + 1] == str(config.num_experts_per_tok)
    assert flags[flags.index("--moe-shared-expert-intermediate-size") + 1] == "40"
    assert "--moe-shared-expert-gate" in flags and "--add-qkv-bias" in flags
    assert ("--moe-router-pre-softmax" in flags) == (not config.norm_topk_prob)
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (load_model(str(tmp_path / "ours"))(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff
    exported = export_hf(str(tmp_path / "ours"), str(tmp_path / "back"), show_progress=False)
    assert exported.arch == QWEN2_MOE
    original, back = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "back"))
    assert sorted(original) == sorted(back) and all(torch.equal(original[k], back[k]) for k in original)
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["norm_topk_prob"] is config.norm_topk_prob and written["model_type"] == QWEN2_MOE
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()  # its config.json too
    with torch.no_grad():
        assert (again(tokens).logits - theirs(tokens).logits).abs().max().item() <= 1e-5
