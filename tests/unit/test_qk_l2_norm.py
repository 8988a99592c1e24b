"""Megatron-LM's `--qk-l2-norm`: megatron-core's weightless L2Norm over each query and key head (the formula, the
module itself, what autograd saves, its FLOPs), in the layer on every query and key head, and the flag through the
config, a resume, `--use-checkpoint-args`, a Megatron-LM checkpoint's args, the planner and Hugging Face export."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megatron_ds.config import Config, ModelConfig, RegularizationConfig
from megatron_ds.estimate.compute import ComputeInputs, layer_terms
from megatron_ds.flags.parser import parse_config
from megatron_ds.interop import hf_architectures
from megatron_ds.interop import megatron_lm_args as saved_args
from megatron_ds.interop.megatron_lm_files import MegatronLMCheckpoint
from megatron_ds.model import norms
from megatron_ds.model.transformer import TransformerLayer
from megatron_ds.plan.inputs import PlanInputs, resolve
from megatron_ds.testing.megatron_lm_checkpoints import namespace, recorded
from megatron_ds.training.checkpoint import rules

EPS = 1e-3  # far from both defaults (--norm-epsilon's 1e-5, megatron-core L2Norm's own 1e-6): the one passed is used
LLAMA = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    ffn_hidden_size=48,
    seq_length=8,
    max_position_embeddings=8,
    vocab_size=128,
    normalization="rmsnorm",
    activation="swiglu",
    use_rotary_position_embeddings=True,
    add_position_embedding=False,
    add_bias_linear=False,
    layernorm_epsilon=EPS,
    qk_l2_norm=True,
)
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
ARGV += ["--vocab-size", "128", "--train-iters", "1", "--lr", "1e-3"]


def _heads(dtype: torch.dtype) -> torch.Tensor:
    """(b, s, heads, head_dim) activations of a scale far from 1, as query heads leave the QKV projection."""
    return (0.1 * torch.randn(2, 5, 4, 8, generator=torch.Generator().manual_seed(0))).to(dtype)


# --- the norm ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_is_x_over_the_root_mean_square_of_each_head(dtype: torch.dtype) -> None:
    x = _heads(dtype)
    module = norms.L2_NORM.module(8, EPS)
    y = module(x)
    assert y.dtype == dtype and list(module.parameters()) == [] and module.state_dict() == {}
    x64 = x.double()
    expected = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + EPS)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: the float32 result rounded once
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)
    assert (expected - x64 / x64.norm(dim=-1, keepdim=True) * 8**0.5).abs().max() > 1e-4  # eps is inside: it counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_is_megatron_cores_module(dtype: torch.dtype) -> None:
    from megatron.core.transformer.torch_norm import L2Norm

    theirs, ours = L2Norm(8, eps=EPS), norms.L2_NORM.module(8, EPS)
    x = _heads(dtype).requires_grad_()
    x_theirs = x.detach().clone().requires_grad_()
    y, y_theirs = ours(x), theirs(x_theirs)
    assert torch.equal(y, y_theirs) and y.dtype == y_theirs.dtype
    grad = torch.randn(y.shape).to(dtype)
    y.backward(grad)
    y_theirs.backward(grad)
    assert torch.equal(x.grad, x_theirs.grad)
    assert not torch.equal(y, L2Norm(8)(x.detach()))  # megatron-core's class default 1e-6 would differ


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_tensors_are_the_float32_input_and_one_statistic_per_head(dtype: torch.dtype) -> None:
    x = _heads(dtype).requires_grad_()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norms.L2_NORM.module(8, EPS)(x)
    stats = {t.data_ptr() for t in saved if t.shape == (*x.shape[:-1], 1)}
    inputs = {t.data_ptr() for t in saved if t.shape == x.shape}
    assert len(stats) == norms.L2_NORM.saved_statistics and len(inputs) == 1
    assert all(t.dtype == torch.float32 for t in saved)
    # fp32: the input itself; bf16: a float32 copy, twice the input's bytes (a term the memory model may add)
    assert (inputs == {x.data_ptr()}) == (dtype == torch.float32)


def test_flops_follow_deepspeeds_profiler_and_the_layer_counts_them() -> None:
    from deepspeed.profiling.flops_profiler.profiler import _layer_norm_flops_compute

    x = _heads(torch.float32)
    # DeepSpeed counts no rms_norm: its weightless layer_norm less the mean, as RMSNorm's entry is its weighted one's
    assert norms.L2_NORM.forward_flops == _layer_norm_flops_compute(x, [8], None)[0] // x.numel() - 1
    for t in (1, 2):
        terms = {term.name: term for term in layer_terms(ComputeInputs(LLAMA, 3, tensor_parallel_size=t))}
        heads = (LLAMA.num_attention_heads + LLAMA.kv_heads) // t
        assert terms["query and key norms"].forward == 3 * 3 * LLAMA.seq_length * heads * LLAMA.head_dim


# --- in the layer -----------------------------------------------------------------------------------------------


def test_every_query_and_key_head_has_a_mean_square_of_one_before_and_after_rotary() -> None:
    layer = TransformerLayer(LLAMA, RegularizationConfig(), 1)
    assert {k for k in layer.state_dict() if "norm" in k} == {"input_norm.weight", "post_attention_norm.weight"}
    assert layer.q_norm.eps == layer.k_norm.eps == EPS  # --norm-epsilon, as megatron-core passes layernorm_epsilon
    tiny_eps = TransformerLayer(dataclasses.replace(LLAMA, layernorm_epsilon=1e-9), RegularizationConfig(), 1)
    q, k, v = tiny_eps.attention_heads(torch.randn(2, LLAMA.seq_length, LLAMA.hidden_size))
    for heads in (q, k):  # rotary keeps each head's mean square: it rotates channel pairs
        torch.testing.assert_close(heads.pow(2).mean(-1), torch.ones(heads.shape[:-1]), rtol=0, atol=1e-5)
    assert v.pow(2).mean(-1).max() < 0.5  # values are left alone (init std 0.02: mean squares near 0.013)
    plain = TransformerLayer(dataclasses.replace(LLAMA, qk_l2_norm=False), RegularizationConfig(), 1)
    assert plain.q_norm is None and plain.state_dict().keys() == layer.state_dict().keys()


# --- the flag and the config --------------------------------------------------------------------------------------


def test_the_flag_sets_the_field_and_replaces_qk_layernorm(capsys: pytest.CaptureFixture) -> None:
    assert parse_config([*ARGV, "--qk-l2-norm"], world_size=1)[0].model.qk_l2_norm
    assert not parse_config(ARGV, world_size=1)[0].model.qk_l2_norm
    assert "WARNING" not in capsys.readouterr().err
    both = parse_config([*ARGV, "--qk-l2-norm", "--qk-layernorm"], world_size=1)[0].model
    assert both.qk_l2_norm and not both.qk_layernorm  # megatron-core's spec: L2Norm if qk_l2_norm else ...
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1 and "--qk-layernorm with --qk-l2-norm" in err
    # one spelling of the same model, also from Python
    assert dataclasses.replace(LLAMA, qk_layernorm=True) == LLAMA
    assert norms.head_norm(LLAMA) is norms.L2_NORM
    assert norms.head_norm(dataclasses.replace(LLAMA, qk_l2_norm=False, qk_layernorm=True)) is norms.find("rmsnorm")


def test_a_resume_with_another_qk_norm_is_refused_and_checkpoint_args_take_it(tmp_path: Path) -> None:
    saved = {"config": Config(model=LLAMA).to_dict()}
    assert rules.architecture_mismatch(saved, Config(model=dataclasses.replace(LLAMA, qk_l2_norm=False))) == [
        "qk_l2_norm True (checkpoint) vs False (now)"
    ]
    older = {"config": Config(model=dataclasses.replace(LLAMA, qk_l2_norm=False)).to_dict()}
    del older["config"]["model"]["qk_l2_norm"]  # a checkpoint written before the field: the default, no L2 norm
    assert rules.architecture_mismatch(older, Config(model=LLAMA)) == ["qk_l2_norm False (checkpoint) vs True (now)"]
    (tmp_path / "global_step0").mkdir()
    body = {"config": saved["config"], "train_state": {}, "layout": "", "world_size": 1, "format": 1}
    (tmp_path / "global_step0" / "megatron_ds.json").write_text(json.dumps(body))
    (tmp_path / "latest").write_text("global_step0")
    train = ["--lr", "1e-3", "--train-iters", "2", "--mock-data"]
    assert parse_config(["--use-checkpoint-args", "--load", str(tmp_path), *train])[0].model == LLAMA


def _megatron_lm_model(**changes: object) -> ModelConfig:
    args = {**vars(namespace(recorded("llama")["args"])), **changes}
    ckpt = MegatronLMCheckpoint("/ckpt/iter_0000005", 5, "torch_dist", args, {"iteration": 5})
    return saved_args.config_from_args(ckpt, saved_args.tokenizer_flags(ckpt, {})[0]).model


def test_a_megatron_lm_runs_saved_qk_l2_norm_is_ours() -> None:
    assert _megatron_lm_model(qk_l2_norm=True).qk_l2_norm and not _megatron_lm_model().qk_l2_norm
    both = _megatron_lm_model(qk_l2_norm=True, qk_layernorm=True)
    assert both.qk_l2_norm and not both.qk_layernorm


def test_the_planner_takes_the_flag() -> None:
    model = resolve(PlanInputs(model="1.3b", architecture=["--qk-l2-norm"])).model()
    assert model.qk_l2_norm and not resolve(PlanInputs(model="1.3b")).model().qk_l2_norm


@pytest.mark.parametrize("model_type", [None, "llama", "qwen3"])
def test_hugging_face_export_is_refused_in_one_line(model_type: str | None) -> None:
    with pytest.raises(hf_architectures.HFConfigError, match="--qk-l2-norm: no type here has a weightless norm") as err:
        hf_architectures.architecture_of(LLAMA, model_type)
    assert "\n" not in str(err.value)
    with pytest.raises(hf_architectures.HFConfigError, match="gpt2: --qk-l2-norm"):
        hf_architectures.architecture_of(dataclasses.replace(LLAMA, activation="gelu", normalization="layernorm"))
